"""torchrun worker for tests/distributed/test_context_parallel.py (gloo, CPU, fp32, 4 ranks). Rank 0 writes a JSON
report.

Every case builds a ParallelDims with cp > 1 (cp=2 with dp_shard=2, or cp=4), runs parallelize() (the cp step,
then FSDP2 over dp_shard x cp) on a tiny HF model, and trains it a few SGD steps on local = split_cp_batch(batch):
each dp rank takes its rows of the global batch, each cp rank its tokens. The reference is plain Hugging Face in
one process (its own sdpa attention and loss, unsplit): each step's loss is the mean over dp of HF's loss on that
dp rank's rows, the gradient its gradient. The report holds per case the max abs differences of the losses and
of every parameter's full gradient over all steps.
MoE cases add parallel.ep (the expert mesh inside dp_shard x cp; transformers >= 5 only, skipped otherwise); the
`aux` case turns the router's aux loss on and compares with its per-cp-slice meaning (per_slice_aux_step); the
`npu` case runs under MINDSPEED_HF_BACKEND=npu (the stand-in torch_npu) and reports each rank's fused-op calls.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "npu_standin"))  # the torch_npu stand-in

from tiny_models import VOCAB, padded_batch, tiny_model  # noqa: E402

from mindspeed_hf.config import MemoryConfig, MindSpeedConfig, ParallelConfig  # noqa: E402
from mindspeed_hf.parallel import (  # noqa: E402
    ParallelDims,
    context_of,
    init_distributed,
    parallelize,
    split_cp_batch,
    unwrap_hf_model,
)
from mindspeed_hf.parallel.context.split import shard_indices  # noqa: E402
from mindspeed_hf.releases.supported import (
    EP_MIN_TRANSFORMERS,  # noqa: E402
    installed,  # noqa: E402
)

STEPS, LR = 2, 0.5
PACKED_ROWS = ((5, 7, 3, 6), (9, 4, 8), (2, 11, 8), (21,))  # 21 tokens each: documents cross every split

# name: model type, model overrides, cp, cp_ulysses, zigzag, batch kind, extras (lora, accum: micro-batches,
# recompute: memory.recompute, ep: parallel.ep, dp_replicate: HSDP, aux: the per-slice router aux loss reference,
# npu: the NPU backend)
CASES = {
    "llama_ring2_padded": ("llama", {}, 2, 1, False, "padded"),
    "llama_ring2_zigzag_packed": ("llama", {}, 2, 1, True, "packed"),
    "qwen3_ring2_zigzag_padded": ("qwen3", {}, 2, 1, True, "padded"),
    "qwen3_ulysses2_packed": ("qwen3", {}, 2, 2, True, "packed"),
    "mistral_window_ring2_zigzag_packed": ("mistral", {"sliding_window": 6}, 2, 1, True, "packed"),
    "mistral_window_ulysses2_padded": ("mistral", {"sliding_window": 6}, 2, 2, True, "padded"),
    "llama_hybrid2x2_zigzag_packed": ("llama", {}, 4, 2, True, "packed"),
    "qwen3_ulysses4_gqa_padded": ("qwen3", {}, 4, 4, True, "padded"),  # 2 kv heads < Ulysses 4
    "qwen3_ring4_contig_packed": ("qwen3", {}, 4, 1, False, "packed"),
    "llama_ring2_lora_accum2_full_recompute": ("llama", {}, 2, 1, True, "packed",
                                               {"lora": True, "accum": 2, "recompute": True}),
    "qwen3_hybrid2x2_accum2_selective_recompute": ("qwen3", {}, 4, 2, True, "padded",
                                                   {"accum": 2, "recompute": "selective"}),
    # HSDP x cp on 4 ranks: dp_replicate 2, FSDP2 over dp_shard 1 x cp 2
    "llama_hsdp2_ring2_zigzag_packed": ("llama", {}, 2, 1, True, "packed", {"dp_replicate": 2}),
    # MoE (output_router_logits off: the aux loss is per slice under cp, see the README)
    "qwen3_moe_ring2_zigzag_packed": ("qwen3_moe", {}, 2, 1, True, "packed"),
    # cp 2 x ep 2 on 4 ranks: efsdp = dp_shard * cp / ep = 2; the experts' 1/ep gradient scale and cp's loss
    # scaling compose
    "qwen3_moe_ring2_ep2_padded": ("qwen3_moe", {}, 2, 1, True, "padded", {"ep": 2}),
    "qwen3_moe_ulysses2_ep2_packed": ("qwen3_moe", {}, 2, 2, False, "packed", {"ep": 2}),
    # the router's aux loss on (coefficient 0.5): what cp trains is HF's loss with the aux term taken per cp slice
    # and averaged over the cp ranks (per_slice_aux_step; README), also with ep 2
    "qwen3_moe_aux_per_slice_ring2_ep2_full": ("qwen3_moe", {"output_router_logits": True, "router_aux_loss_coef": 0.5},
                                               2, 1, True, "full", {"ep": 2, "aux": True}),
    # MINDSPEED_HF_BACKEND=npu (the stand-in): the ring's blocks through npu_fusion_attention(_grad), counted
    "llama_npu_ring2_zigzag_packed": ("llama", {}, 2, 1, True, "packed", {"npu": True}),
}
NPU_OPS = ("npu_fusion_attention", "npu_fusion_attention_grad")
EP_READY = installed("transformers").major >= int(EP_MIN_TRANSFORMERS.split(".")[0])


def run_npu_case(name: str, spec) -> dict:
    """run_case with MINDSPEED_HF_BACKEND=npu (the stand-in torch_npu), each op of NPU_OPS wrapped and counted;
    the calls of every rank join the report."""
    import torch_npu

    from mindspeed_hf.ops import registry

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, {"MINDSPEED_HF_BACKEND": "npu"}))
        stack.callback(registry.set_backend, None)  # the environment is read again once it is restored
        ops = {op: stack.enter_context(mock.patch.object(torch_npu, op, wraps=getattr(torch_npu, op)))
               for op in NPU_OPS}
        registry.set_backend(None)
        out = run_case(name, spec)
        calls = {op: wrapper.call_count for op, wrapper in ops.items()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, calls)
    return {**out, "npu_calls": gathered}


def packed_rows(rows, seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    total = sum(rows[0])
    ids = torch.randint(1, VOCAB, (len(rows), total), generator=gen)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    labels = ids.masked_fill(positions == 0, -100)  # a document's first token is not predicted across documents
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def global_batch(kind: str, step: int) -> dict[str, torch.Tensor]:
    if kind == "packed":
        return packed_rows(PACKED_ROWS, seed=3 + step)
    if kind == "full":  # no padding at all, 24 tokens: a multiple of 2 * cp, so the split adds none either
        ids = torch.randint(1, VOCAB, (4, 24), generator=torch.Generator().manual_seed(5 + step))
        return {"input_ids": ids, "labels": ids.clone()}
    return padded_batch(batch=4, seq=19, seed=1 + step)


def rows(batch: dict, dp: int, dp_rank: int) -> dict:
    return {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}


def valid(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def reference_step(model, batch: dict, dp: int, accum: int) -> float:
    """Plain HF, one process: the mean over dp ranks of HF's loss on each rank's rows (micro-batches summed with
    Trainer's num_items_in_batch of the rank's rows); its gradient."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for d in range(dp):
        mine = rows(batch, dp, d)
        for micro in range(accum):
            loss = model(**rows(mine, accum, micro), num_items_in_batch=valid(mine), use_cache=False).loss / dp
            loss.backward()
            total += loss.item()
    return total


def per_slice_aux_step(model, batch: dict, dp: int, cp: int, zigzag: bool, ulysses: int) -> float:
    """The loss cp trains when the router's aux loss is on, from plain HF in one process: per dp rank, HF's loss
    without its aux term plus the coefficient times the mean over the cp ranks of HF's own load_balancing_loss_func
    on the router logits of the tokens each cp rank holds; averaged over dp. Its gradient."""
    model.zero_grad(set_to_none=True)
    config, seq = model.config, batch["input_ids"].shape[1]
    aux_of = sys.modules[type(model).__module__].load_balancing_loss_func
    slices = [shard_indices(seq, cp, r, zigzag, ulysses) for r in range(cp)]  # seq needs no padding (kind "full")
    total = 0.0
    for d in range(dp):
        out = model(**rows(batch, dp, d), use_cache=False)
        per_slice = [aux_of(tuple(layer.view(-1, seq, layer.shape[-1])[:, idx].flatten(0, 1)
                                  for layer in out.router_logits), config.num_experts, config.num_experts_per_tok)
                     for idx in slices]
        coef = config.router_aux_loss_coef
        loss = (out.loss - coef * out.aux_loss + coef * torch.stack(per_slice).mean()) / dp
        loss.backward()
        total += loss.item()
    return total


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():  # non-zero B so the adapter matters from the first step
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


def full_grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def sgd(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad


def run_case(name: str, spec) -> dict[str, float]:
    model_type, overrides, cp, ulysses, zigzag, kind, *extra = spec
    extra = extra[0] if extra else {}
    accum = extra.get("accum", 1)
    world = dist.get_world_size()
    ep, replicate = extra.get("ep", 1), extra.get("dp_replicate", 1)
    dims = ParallelDims(dp_replicate=replicate, dp_shard=-1, cp=cp, cp_ulysses=ulysses, ep=ep, world_size=world)
    dims.build_mesh("cpu")
    dp, dp_rank = dims.dp_size, dims.get_mesh("dp").get_local_rank()
    reference = tiny_model(model_type, **overrides)
    if extra.get("lora"):
        reference = with_lora(reference)
    config = MindSpeedConfig(parallel=ParallelConfig(dp_replicate=replicate, cp=cp, cp_ulysses=ulysses,
                                                     cp_zigzag=zigzag, ep=ep),
                             memory=MemoryConfig(recompute=extra.get("recompute", False)))
    model = parallelize(copy.deepcopy(reference), dims, config)
    assert unwrap_hf_model(model).config._attn_implementation == "mindspeed_cp"
    ctx = context_of(model)
    loss_diff = grad_diff = 0.0
    for step in range(STEPS):
        batch = global_batch(kind, step)
        expected = (per_slice_aux_step(reference, batch, dp, cp, zigzag, ulysses) if extra.get("aux")
                    else reference_step(reference, batch, dp, accum))
        model.zero_grad(set_to_none=True)
        mine, mean = rows(batch, dp, dp_rank), torch.zeros(())
        for micro in range(accum):
            loss = model(**split_cp_batch(rows(mine, accum, micro), ctx, num_items_in_batch=valid(mine))).loss
            loss.backward()
            mean += loss.detach()
        dist.all_reduce(mean)  # each rank's loss is cp x its share: the world mean is the dp mean of HF's losses
        loss_diff = max(loss_diff, abs(mean.item() / world - expected))
        got, want = full_grads(model), full_grads(reference)
        assert got.keys() == want.keys()
        grad_diff = max(grad_diff, max((got[n] - want[n]).abs().max().item() for n in want))
        sgd(model)
        sgd(reference)
    return {"loss": loss_diff, "grad": grad_diff}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="", help="comma-separated case names (default: all)")
    args = parser.parse_args()
    out, only = args.out, [n for n in args.only.split(",") if n]
    init_distributed("cpu")
    torch.use_deterministic_algorithms(True)
    chosen = {name: spec for name, spec in CASES.items() if (not only or name in only)
              and (EP_READY or not (spec[6:] and spec[6].get("ep")))}  # ep needs transformers' fused experts
    report = {name: (run_npu_case if spec[6:] and spec[6].get("npu") else run_case)(name, spec)
              for name, spec in chosen.items()}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
