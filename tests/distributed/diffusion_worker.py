"""torchrun worker for tests/distributed/test_diffusion_parallel.py (gloo, 2 CPU ranks, fp32). Rank 0 writes JSON.

For a tiny Flux or Wan (tests/tiny_denoisers.py) every rank first computes plain diffusers' flow-matching loss and
gradients on the whole batch (one process's reference, mindspeed_hf off), then for each case enables mindspeed_hf,
calls `mindspeed_hf.parallel.parallelize(model, dims, config)` directly and trains one step:
- cp cases (cp=2: ring, or Ulysses): every rank gets the whole batch; the model splits its tokens by its _cp_plan;
  gradients averaged over the cp group (what FSDP2 over dp_shard x cp does);
- fsdp (dp_shard=2): each rank gets half the batch; FSDP2 per transformer block averages the gradients;
- cp_hybrid (4 ranks, cp=4 = a ring of 2 Ulysses pairs).
Under cp=2 parallelize shards the parameters over the cp ranks too (FSDP2 over dp_shard x cp), which averages the
gradients over the cp group.
Reported per case: the loss difference, the worst gradient error relative to each tensor's largest entry, the
sequence lengths the npu attention kernel saw (npu backend cases: each rank attends over its half of the tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tiny_denoisers
sys.path.insert(0, str(HERE.parent / "npu_standin"))  # the torch_npu stand-in

import mindspeed_hf  # noqa: E402
from mindspeed_hf.config import config_from_dict  # noqa: E402
from mindspeed_hf.device import import_torch_npu  # noqa: E402
from mindspeed_hf.parallel import ParallelDims, init_distributed  # noqa: E402
from mindspeed_hf.parallel.parallelize import parallelize  # noqa: E402

CASES = {
    "cp_ring": ({"cp": 2, "dp_shard": 1}, "npu"),
    "cp_ulysses": ({"cp": 2, "cp_ulysses": 2, "dp_shard": 1}, "torch"),
    "fsdp": ({"dp_shard": 2}, "npu"),
    "cp_hybrid": ({"cp": 4, "cp_ulysses": 2, "dp_shard": 1}, "npu"),  # 4 ranks: a ring of 2 Ulysses pairs
}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient in full: FSDP2's (averaged over its ranks) gathered, any other averaged over the world."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if hasattr(p.grad, "full_tensor"):
            grad = p.grad.full_tensor()
        else:
            grad = p.grad.detach().clone()
            dist.all_reduce(grad, op=dist.ReduceOp.AVG)
        out[name] = grad
    return out


def _rel_error(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    assert want.keys() == got.keys(), set(want) ^ set(got)
    return max(float((got[n] - w).abs().max() / w.abs().max().clamp_min(1e-6)) for n, w in want.items())


def run_case(family: str, name: str, reference) -> dict:
    import tiny_denoisers as T

    sizes, backend = CASES[name]
    tiny = T.FAMILIES[family]()
    kwargs, target, weighting = T.noisy_batch(tiny)
    world, rank = dist.get_world_size(), dist.get_rank()
    if sizes.get("cp", 1) == 1:  # data parallel: each rank its half of the batch
        kwargs = {k: v.chunk(world)[rank] if isinstance(v, torch.Tensor) and v.shape[:1] == (T.BATCH,) else v
                  for k, v in kwargs.items()}
        target, weighting = target.chunk(world)[rank], weighting.chunk(world)[rank]
    config = config_from_dict({"backend": backend, "parallel": sizes})
    mindspeed_hf.enable(config)
    mindspeed_hf.apply_to_model(tiny.model, config)
    dims = ParallelDims(world_size=world, **sizes)
    dims.build_mesh("cpu")
    seen = []
    npu = import_torch_npu()
    real = npu.npu_fusion_attention

    def recording(q, k, v, heads, layout, *args, **kw):
        seen.append(q.shape[{"BNSD": 2, "BSND": 1}[layout]])  # the query tokens of this call
        return real(q, k, v, heads, layout, *args, **kw)

    npu.npu_fusion_attention = recording
    try:
        model = parallelize(tiny.model, dims, config)
        tiny.model = model
        loss = T.loss_of(tiny, (kwargs, target, weighting))
        loss.backward()
    finally:
        npu.npu_fusion_attention = real
    grads = _grads(model)
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
    report = mindspeed_hf.report(model)
    mindspeed_hf.disable()
    return {"loss_diff": abs(float(mean_loss) - float(reference[0])), "grad_error": _rel_error(reference[1], grads),
            "attention_lengths": sorted(set(seen)), "ran_attention": report["ran"]["attention"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    init_distributed("cpu")
    torch.manual_seed(0)
    import tiny_denoisers as T

    results = {}
    for name in args.cases.split(","):
        tiny = T.FAMILIES[args.family]()
        reference = T.loss_and_grads(tiny, T.noisy_batch(tiny))
        results[name] = run_case(args.family, name, reference)
        dist.barrier()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
