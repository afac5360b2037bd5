"""torchrun worker for tests/distributed/test_tensor_parallel.py (gloo, CPU, fp32). Rank 0 writes a JSON report.

Each case first trains the unpatched model in plain Hugging Face (mindspeed_hf disabled, HF's own loss) on rank 0,
then enables mindspeed_hf, builds the same model (same seed), applies it (`apply_to_model`), shards it with
`apply_tensor_parallel` over tp and trains it on the same batches; it reports both runs' per-step losses, the
largest difference of the first step's gathered gradients, each sharded weight's placements and local size, and
what report(model)["ran"] counted. Scenarios: `two` (2 ranks, tp=2), `four` (4 ranks, dp_shard=2 x tp=2 with
FSDP2 over the dp sub-mesh).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "npu_standin"))  # the torch_npu stand-in
from tiny_models import VOCAB, tiny_model  # noqa: E402

import mindspeed_hf  # noqa: E402
from mindspeed_hf.ops import registry  # noqa: E402
from mindspeed_hf.parallel import init_distributed  # noqa: E402
from mindspeed_hf.parallel.tensor import (  # noqa: E402
    apply_tensor_parallel,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
)

BATCH, SEQ, STEPS, LR = 4, 12, 3, 1e-3


def batch(step: int, seq: int = SEQ) -> dict[str, torch.Tensor]:
    """input_ids, labels and attention_mask: row 0 right-padded from position 7, row -1's prompt unlabelled."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    labels = ids.clone()
    labels[0, 7:] = -100
    labels[BATCH - 1, :4] = -100
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def n_items(step: int, seq: int = SEQ) -> int:
    return int((batch(step, seq)["labels"][:, 1:] != -100).sum())


@contextlib.contextmanager
def kernel_spy(seen: dict):
    """Records what our kernels receive: any DTensor argument (they take plain tensors), the heads attention sees
    and the sequence lengths the RMSNorms run on."""
    chosen = registry._chosen  # where registry.run and registry.select pick every kernel

    def spied(op, requested, device):
        kernel = chosen(op, requested, device)

        def fn(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            seen["dtensor_args"] = seen.get("dtensor_args", 0) + sum(isinstance(t, DTensor) for t in tensors)
            if op == "attention":
                seen.setdefault("attention_heads", set()).add(args[1].shape[1])
            if op == "rms_norm" and args[0].dim() == 3:
                seen.setdefault("norm_rows", set()).add(args[0].shape[1])
            return kernel.fn(*args, **kwargs)

        return dataclasses.replace(kernel, fn=fn)

    registry._chosen = spied
    try:
        yield
    finally:
        registry._chosen = chosen
        seen.update({k: sorted(v) for k, v in seen.items() if isinstance(v, set)})


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def train(model, rows: slice, scale: float, group=None, seq: int = SEQ, mask: bool = False,
          **kwargs) -> tuple[list[float], dict[str, torch.Tensor]]:
    """STEPS AdamW steps on rows `rows` of each batch (with its padding mask if `mask`), the loss a sum over the
    global batch's items; returns the losses (summed over `group`) and the first step's gathered gradients."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        inputs = {k: v[rows] for k, v in batch(step, seq).items() if mask or k != "attention_mask"}
        loss = model(**inputs, num_items_in_batch=n_items(step, seq), **kwargs).loss
        (loss * scale).backward()
        grads = grads or {n: full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if group is not None:
            dist.all_reduce(total, group=group)
        losses.append(total.item())
    return losses, grads


def reference(family: str, **batch_kw) -> dict:
    """Plain HF, unpatched, one process, the whole batch."""
    mindspeed_hf.disable()
    losses, grads = train(tiny_model(family), slice(None), 1.0, **batch_kw)
    return {"losses": losses, "grads": grads}


def placements(model) -> dict[str, list]:
    """name -> [placements, local numel / global numel] of every parameter."""
    return {n: [str(p.placements), p.to_local().numel() / p.numel()] for n, p in model.named_parameters()}


def compare(got: dict, ref: dict | None) -> dict:
    if ref is None:
        return {}
    diffs = {n: (g - ref["grads"][n]).abs().max().item() for n, g in got["grads"].items()}
    return {"ref_losses": ref["losses"], "same_names": sorted(diffs) == sorted(ref["grads"]),
            "grad_max_diff": max(diffs.values()), "grad_max_at": max(diffs, key=diffs.get),
            "loss_max_diff": max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))}


def case(family: str, sequence_parallel: bool = True, backend: str | None = None, **batch_kw) -> dict:
    """tp over the whole world against plain HF in one process (`batch_kw`: train's seq / mask)."""
    ref = reference(family, **batch_kw) if dist.get_rank() == 0 else None
    if backend:
        os.environ["MINDSPEED_HF_BACKEND"] = backend
        registry.set_backend(None)  # re-read the environment
    try:
        mindspeed_hf.enable()
        model = tiny_model(family)
        mindspeed_hf.apply_to_model(model)
        mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)
        seen: dict = {}
        with kernel_spy(seen):
            losses, grads = train(model, slice(None), 1.0, skip_logits=True, **batch_kw)
        out = {"losses": losses, "grads": grads, "seen": seen, "ran": mindspeed_hf.report(model)["ran"],
               "backend": mindspeed_hf.report(model)["backend"], "placements": placements(model),
               "attention": model.config._attn_implementation}
    finally:
        mindspeed_hf.disable()
        os.environ.pop("MINDSPEED_HF_BACKEND", None)
        registry.set_backend(None)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out["ran"])
    out["ran_per_rank"] = gathered
    out.update(compare(out, ref))
    del out["grads"]
    return out


def dp_tp_case(family: str) -> dict:
    """dp_shard=2 x tp=2: tp inside each dp group, FSDP2 over the dp sub-mesh of the 2-D mesh; each dp rank
    trains its half of every batch."""
    from torch.distributed.fsdp import fully_shard

    ref = reference(family) if dist.get_rank() == 0 else None
    mindspeed_hf.enable()
    try:
        model = tiny_model(family)
        mindspeed_hf.apply_to_model(model)
        mesh = dist.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        apply_tensor_parallel(model, mesh["tp"])
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        dp = mesh["dp"].get_local_rank()
        per = BATCH // 2
        losses, grads = train(model, slice(dp * per, (dp + 1) * per), 2.0, group=mesh["dp"].get_group(),
                              skip_logits=True)
        out = {"losses": losses, "grads": grads, "ran": mindspeed_hf.report(model)["ran"],
               "placements": placements(model)}
    finally:
        mindspeed_hf.disable()
    out.update(compare(out, ref))
    del out["grads"]
    return out


def vocab_parallel() -> dict:
    """vocab_parallel_cross_entropy on each rank's vocab slice vs F.cross_entropy on the full logits."""
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(10, VOCAB, generator=g) * 4
    target = torch.randint(0, VOCAB, (10,), generator=g)
    full_logits = logits.clone().requires_grad_(True)
    want = torch.nn.functional.cross_entropy(full_logits, target, reduction="sum")
    want.backward()
    per = VOCAB // world
    local = logits[:, rank * per:(rank + 1) * per].clone().requires_grad_(True)
    got = vocab_parallel_cross_entropy(local, target, rank * per, dist.group.WORLD)
    got.backward()
    grad_diff = (local.grad - full_logits.grad[:, rank * per:(rank + 1) * per]).abs().max().item()
    out = {"loss_rel_diff": abs(got.item() - want.item()) / want.item(), "grad_diff": grad_diff}
    out["linear"] = vocab_parallel_linear()
    return out


def vocab_parallel_linear() -> dict:
    """vocab_parallel_linear_cross_entropy on the tp-sharded lm_head of a tiny llama (chunks of 4 rows) vs
    F.cross_entropy(lm_head(hidden)) in one process: loss, hidden gradient, gathered weight gradient."""
    plain = tiny_model("llama").lm_head
    model = tiny_model("llama")
    mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    apply_tensor_parallel(model, mesh["tp"])
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(10, plain.in_features, generator=g)
    target = torch.randint(0, VOCAB, (10,), generator=g)
    h1, h2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    want = torch.nn.functional.cross_entropy(plain(h1), target, reduction="sum")
    want.backward()
    got = vocab_parallel_linear_cross_entropy(h2, model.lm_head, target, chunk_size=4)
    got.backward()
    return {"loss_rel_diff": abs(got.item() - want.item()) / want.item(),
            "hidden_grad_diff": (h1.grad - h2.grad).abs().max().item(),
            "weight_grad_diff": (plain.weight.grad - model.lm_head.weight.grad.full_tensor()).abs().max().item()}


def errors() -> dict:
    """One-line errors before any work."""
    mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    out = {}
    for label, family, kw in (("heads", "llama", {"num_attention_heads": 3, "num_key_value_heads": 3,
                                                  "hidden_size": 48}),
                              ("tied", "llama", {"tie_word_embeddings": True})):
        model = tiny_model(family, **kw)
        try:
            apply_tensor_parallel(model, mesh)
            out[label] = "no error"
        except ValueError as err:
            out[label] = str(err)
        out[label + "_untouched"] = not any(isinstance(p, DTensor) for p in model.parameters())
    return out


def scenario_two() -> dict:
    return {
        "llama": case("llama"),
        "qwen3": case("qwen3"),
        "qwen3_moe": case("qwen3_moe"),
        "llama_no_sp": case("llama", sequence_parallel=False),
        "padded_odd": case("llama", seq=13, mask=True),  # uneven sequence shards (7 + 6), a padding mask
        "npu": case("qwen3", backend="npu"),
        "qwen3_moe_npu": case("qwen3_moe", backend="npu"),  # our experts kernel on the local shards (torch: HF's)
        "vocab_parallel": vocab_parallel(),
        "errors": errors(),
    }


def scenario_four() -> dict:
    return {"dp_tp": dp_tp_case("llama")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["two", "four"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    init_distributed("cpu")
    out = {"two": scenario_two, "four": scenario_four}[a.scenario]()
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
