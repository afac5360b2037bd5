"""torchrun worker for tests/distributed/test_context_attention.py (gloo, CPU, fp32). Rank 0 writes a JSON report.

Every case draws global q / k / v (the same on every rank), gives each rank its slice through the splitter, runs
ring / Ulysses / hybrid attention, and compares the gathered output and q / k / v gradients with plain torch SDPA
on the whole sequence in one process (GQA by HF's repeat_kv, packed documents by a block-diagonal mask built here
from the document lengths). Reports max abs differences per case; on the npu backend (the torch_npu stand-in)
also how often npu_fusion_attention / npu_fusion_attention_grad ran on each rank.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from transformers.integrations.sdpa_attention import repeat_kv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "npu_standin"))  # the torch_npu stand-in

from mindspeed_hf.ops import registry  # noqa: E402
from mindspeed_hf.parallel.context import (  # noqa: E402
    context_attention,
    gather_sequence,
    heads_to_seq,
    ring_attention,
    seq_to_heads,
    split_batch,
    ulysses_attention,
)
from mindspeed_hf.parallel.context.ulysses import gather_sequence_ids  # noqa: E402

BATCH, HEADS, DIM = 2, 4, 8


def reference(q, k, v, dout, case: dict):
    """Plain SDPA on the whole sequence (one process): output and q / k / v gradients. Packed documents and the
    sliding window (HF's: i - j < window) as a mask built from token indices."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    seq, causal, docs, window = q.shape[2], case["causal"], case.get("docs"), case.get("window")
    mask = None
    if docs is not None or window is not None:
        doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs)) if docs else torch.zeros(seq)
        idx = torch.arange(seq)
        mask = (doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None])
        if window is not None:
            mask = mask & (idx[:, None] - idx[None, :] < window)
    out = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask,
                                         is_causal=causal and mask is None)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def draw(case: dict, seed: int):
    g = torch.Generator().manual_seed(seed)
    seq, kv_heads = case["seq"], case.get("kv_heads", HEADS)
    q = torch.randn(BATCH, HEADS, seq, DIM, generator=g)
    k = torch.randn(BATCH, kv_heads, seq, DIM, generator=g)
    v = torch.randn(BATCH, kv_heads, seq, DIM, generator=g)
    dout = torch.randn(BATCH, HEADS, seq, DIM, generator=g)
    return q, k, v, dout


def positions_of(case: dict) -> torch.Tensor:
    docs = case.get("docs")
    if docs is None:
        return torch.arange(case["seq"]).expand(BATCH, -1)
    return torch.cat([torch.arange(n) for n in docs]).expand(BATCH, -1)


def local_slices(case: dict, cp: int, rank: int, zigzag: bool, ulysses: int, tensors):
    """This rank's piece of q, k, v, dout ([B, N, S, D], via the splitter's token order), its segment ids and
    global position ids."""
    seq = case["seq"]
    pos = positions_of(case)
    part = split_batch(pos.clone(), position_ids=pos, cp=cp, rank=rank, zigzag=zigzag, ulysses=ulysses,
                       with_segments=True if case.get("docs") or not case["causal"] else None)
    # The global index of every local token: split_batch's padded positions are the token indices when unpacked.
    index = split_batch(torch.arange(seq).expand(BATCH, -1), cp=cp, rank=rank, zigzag=zigzag,
                        ulysses=ulysses)["position_ids"][0]
    padded = [F.pad(t, (0, 0, 0, int(index.max()) + 1 - seq)) for t in tensors]
    # Padded q / k / v are random: they must stay invisible (causal tail, or their own segment); the padded rows'
    # output gradient stays 0 (their labels are ignored).
    for t in padded[:3]:
        t[:, :, seq:] = torch.randn_like(t[:, :, seq:])
    return [t[:, :, index].contiguous() for t in padded], part["segment_ids"], part["position_ids"]


def compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(got, want))


def gathered(tensors, group, seq: int, zigzag: bool, ulysses: int = 1):
    return [gather_sequence(t.detach(), group, seq, zigzag=zigzag, ulysses=ulysses, dim=2) for t in tensors]


def run_case(case: dict, seed: int, group, mesh=None) -> float:
    """One attention case on this group; returns the max abs diff of output and gradients vs the fp32
    reference (for a bf16 case: that diff divided by the one of plain bf16 SDPA in one process)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    kind, zigzag, causal = case["kind"], case.get("zigzag", False), case["causal"]
    ulysses = case.get("ulysses", cp if kind.startswith("ulysses") else 1)
    q, k, v, dout = draw(case, seed)
    dtype = getattr(torch, case.get("dtype", "float32"))
    q, k, v, dout = (t.to(dtype).float() for t in (q, k, v, dout))  # the reference sees the rounded inputs
    want = reference(q, k, v, dout, case)
    (lq, lk, lv, ldout), segs, pos = local_slices(case, cp, rank, zigzag, ulysses, [q, k, v, dout])
    lq, lk, lv = (t.to(dtype).requires_grad_() for t in (lq, lk, lv))
    ldout = ldout.to(dtype)
    window = {"sliding_window": case.get("window"), "position_ids": pos}
    if kind == "ring":  # the default group as None, as a caller would pass it
        ring_group = None if group is dist.group.WORLD else group
        out = ring_attention(lq, lk, lv, ring_group, causal=causal, zigzag=zigzag, segment_ids=segs, **window)
    elif kind == "ulysses":  # around plain SDPA on the gathered sequence
        u_segs = None if segs is None else gather_sequence_ids(segs, group)
        out = ulysses_attention(lq, lk, lv, group, functools.partial(local_sdpa, causal=causal, segs=u_segs))
    elif kind == "ulysses_kernel":  # around the device block kernel (no ring)
        out = context_attention(lq, lk, lv, ulysses_group=group, causal=causal, segment_ids=segs, **window)
    else:  # hybrid: the ring across the ring dimension on each Ulysses group's piece
        out = context_attention(lq, lk, lv, ring_group=mesh["ring"].get_group(),
                                ulysses_group=mesh["ulysses"].get_group(), causal=causal, zigzag=zigzag,
                                segment_ids=segs, **window)
    out.backward(ldout)
    got = gathered([t.float() for t in (out, lq.grad, lk.grad, lv.grad)], group, case["seq"], zigzag, ulysses)
    if dtype == torch.float32:
        return compare(got, list(want))
    # Lower precision: the error relative to plain SDPA run in that dtype in one process.
    base = reference(*(t.to(dtype) for t in (q, k, v, dout)), case)
    return compare(got, list(want)) / compare([t.float() for t in base], list(want))


def local_sdpa(q, k, v, causal: bool, segs):
    """Plain SDPA on the gathered sequence (the Ulysses inner kernel in these tests)."""
    mask = None
    if segs is not None:
        mask = (segs[:, None, :, None] == segs[:, None, None, :])
        if causal:
            mask = mask & torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask,
                                          is_causal=causal and mask is None)


def round_trip(group) -> dict:
    """seq_to_heads gives each rank its heads over the whole sequence; heads_to_seq undoes it exactly."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(7)
    full = torch.randn(BATCH, 2 * cp, 3 * cp, DIM, generator=g)
    local = full.chunk(cp, dim=2)[rank].contiguous()
    heads = seq_to_heads(local, group)
    back = heads_to_seq(heads, group)
    return {"heads_exact": bool(torch.equal(heads, full.chunk(cp, dim=1)[rank])),
            "back_exact": bool(torch.equal(back, local))}


class Counter:
    """Counts the stand-in's npu_fusion_attention / npu_fusion_attention_grad calls on this rank."""

    def __init__(self) -> None:
        import torch_npu

        self.module, self.counts = torch_npu, {"npu_fusion_attention": 0, "npu_fusion_attention_grad": 0}
        self.saved = {name: getattr(torch_npu, name) for name in self.counts}
        for name, fn in self.saved.items():
            setattr(torch_npu, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.counts[name] += 1
            return fn(*args, **kwargs)

        return counted

    def restore(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.module, name, fn)


def all_counts(counts: dict, group) -> list[dict]:
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, counts, group=group)
    return out


def cases_for(world: int) -> dict[str, dict]:
    seq = 6 * world + 1  # odd, padded by the splitter
    docs = [3, 2 * world + 1, seq - 2 * world - 4]  # the middle document crosses rank boundaries
    cases = {}
    for kind in ("ring",):
        for causal in (True, False):
            for zigzag in (False, True):
                name = f"{kind}_{'causal' if causal else 'full'}_{'zigzag' if zigzag else 'contig'}"
                cases[name] = {"kind": kind, "seq": seq, "causal": causal, "zigzag": zigzag}
    cases["ring_gqa"] = {"kind": "ring", "seq": seq, "causal": True, "zigzag": True, "kv_heads": 2}
    cases["ring_window"] = {"kind": "ring", "seq": seq, "causal": True, "zigzag": False, "window": 4}
    cases["ring_window_packed_zigzag"] = {"kind": "ring", "seq": seq, "causal": True, "zigzag": True, "window": 5,
                                          "docs": docs}
    cases["bf16_ring_zigzag_packed"] = {"kind": "ring", "seq": seq, "causal": True, "zigzag": True, "docs": docs,
                                        "kv_heads": 2, "dtype": "bfloat16"}
    cases["ring_mqa"] = {"kind": "ring", "seq": seq, "causal": True, "zigzag": False, "kv_heads": 1}
    cases["ring_packed"] = {"kind": "ring", "seq": seq, "causal": True, "zigzag": False, "docs": docs}
    cases["ring_packed_zigzag"] = {"kind": "ring", "seq": seq, "causal": True, "zigzag": True, "docs": docs,
                                   "kv_heads": 2}
    seq_u = 4 * world  # Ulysses splits contiguously
    cases["ulysses_causal"] = {"kind": "ulysses", "seq": seq_u + 1, "causal": True}
    cases["ulysses_gqa"] = {"kind": "ulysses", "seq": seq_u, "causal": True, "kv_heads": 1}
    cases["ulysses_packed"] = {"kind": "ulysses", "seq": seq_u, "causal": True, "docs": [5, seq_u - 5]}
    cases["ulysses_kernel_packed_gqa"] = {"kind": "ulysses_kernel", "seq": seq_u + 3, "causal": True,
                                          "docs": [5, seq_u - 2], "kv_heads": 1, "window": 3}
    return cases


def hybrid_cases(world: int) -> dict[str, dict]:
    seq = 4 * world + 3
    docs = [4, 7, seq - 11]
    return {
        "hybrid_causal": {"kind": "hybrid", "seq": seq, "causal": True, "ulysses": 2},
        "hybrid_zigzag_gqa": {"kind": "hybrid", "seq": seq, "causal": True, "zigzag": True, "ulysses": 2,
                              "kv_heads": 1},
        "hybrid_packed": {"kind": "hybrid", "seq": seq, "causal": True, "zigzag": True, "ulysses": 2, "docs": docs},
        "hybrid_window": {"kind": "hybrid", "seq": seq, "causal": True, "zigzag": True, "ulysses": 2, "docs": docs,
                          "window": 6},
    }


def npu_cases(world: int) -> dict[str, dict]:
    return {
        "npu_ring_contig": {"kind": "ring", "seq": 4 * world, "causal": True},
        "npu_ring_zigzag_gqa": {"kind": "ring", "seq": 4 * world, "causal": True, "zigzag": True, "kv_heads": 2},
        "npu_ring_packed": {"kind": "ring", "seq": 4 * world + 1, "causal": True, "docs": [3, 4 * world - 2],
                            "window": 4 * world},
        "npu_ulysses_kernel": {"kind": "ulysses_kernel", "seq": 4 * world, "causal": True},
    }


def suite(group, mesh=None) -> dict:
    """Every case on `group` (the hybrid ones when `mesh` is given); diffs from this rank's point of view."""
    world = dist.get_world_size(group)
    report: dict = {"world": world, "diffs": {}, "round_trip": round_trip(group), "npu_counts": {}}
    for i, (name, case) in enumerate(cases_for(world).items()):
        report["diffs"][name] = run_case(case, 100 + i, group)
    if mesh is not None:
        for i, (name, case) in enumerate(hybrid_cases(world).items()):
            report["diffs"][name] = run_case(case, 200 + i, group, mesh)
    registry.set_backend("npu")
    for i, (name, case) in enumerate(npu_cases(world).items()):
        counter = Counter()
        report["diffs"][name] = run_case(case, 300 + i, group)
        counter.restore()
        report["npu_counts"][name] = all_counts(counter.counts, group)
    registry.set_backend(None)
    return report


def main() -> None:
    """4 ranks: cp=2 on the two pairs {0, 1} and {2, 3} at once (groups whose ranks are not the global ones),
    then cp=4 on all ranks with the hybrid ring 2 x Ulysses 2 (Ulysses innermost)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if dist.get_world_size() != 4:
        raise SystemExit("context_worker runs on 4 ranks")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    pairs: list = [None] * 4
    dist.all_gather_object(pairs, suite(mesh["ulysses"].get_group()))
    report = {"cp2": pairs[0], "cp2_second_pair": pairs[2], "cp4": suite(dist.group.WORLD, mesh)}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
