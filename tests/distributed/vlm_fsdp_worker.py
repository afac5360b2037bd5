"""torchrun worker (gloo, 2 ranks): a tiny Qwen2.5-VL under FSDP2 with mindspeed_hf (fused loss, varlen vision
attention, vision RMSNorm / SwiGLU / rope) against plain HF in one process, for a full fine-tune and for LoRA on the
language model with the vision tower frozen. Rank 0 writes a JSON report to --out."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_vlms

from tiny_vlms import GRIDS, SAMPLE_IMAGES, tiny_vlm, vlm_batch  # noqa: E402

import mindspeed_hf  # noqa: E402
from mindspeed_hf.config import config_from_dict  # noqa: E402
from mindspeed_hf.parallel.dims import ParallelDims, fsdp_mesh, init_distributed  # noqa: E402
from mindspeed_hf.parallel.fsdp import apply_fsdp  # noqa: E402

STEPS, LR = 2, 0.1  # SGD: weights move by LR x gradient, so a gradient difference shows as is


def build(lora: bool):
    model = tiny_vlm("qwen2_5_vl")
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8,
                                                 target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)"))
        with torch.no_grad():  # non-zero B so the adapters matter from step 0
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.05)
    return model


def batches(model) -> list[dict]:
    return [vlm_batch(model, left=bool(step % 2), seed=10 + step) for step in range(STEPS)]


def rank_share(batch: dict, rank: int) -> dict:
    """Sample `rank` of the batch with its own images (pixel rows and grids)."""
    sizes = [t * h * w for t, h, w in GRIDS]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    images = SAMPLE_IMAGES[rank]
    rows = torch.cat([torch.arange(starts[i], starts[i] + sizes[i]) for i in images])
    share = {k: v[rank:rank + 1] for k, v in batch.items() if k not in ("pixel_values", "image_grid_thw")}
    share["pixel_values"] = batch["pixel_values"][rows]
    share["image_grid_thw"] = batch["image_grid_thw"][list(images)]
    return share


def items(batch: dict) -> torch.Tensor:
    return (batch["labels"][:, 1:] != -100).sum()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: _full(p) for n, p in model.named_parameters() if p.requires_grad}


def grads(model) -> dict[str, torch.Tensor]:
    """Every gradient, gathered (collective)."""
    return {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max((a[n] - b[n]).abs().max().item() for n in a)


def reference(lora: bool) -> tuple[list[float], dict]:
    model = build(lora)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, first = [], None
    for batch in batches(model):
        loss = model(**batch, num_items_in_batch=items(batch)).loss
        loss.backward()
        first = first or grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, trainable(model), first


def sharded(lora: bool, rank: int, world: int) -> tuple[list[float], dict, dict, dict]:
    model = build(lora)
    report = mindspeed_hf.apply_to_model(model)
    dims = ParallelDims(world_size=world)
    apply_fsdp(model, fsdp_mesh(dims.build_mesh("cpu"), dims))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, first = [], None
    for batch in batches(model):
        loss = model(**rank_share(batch, rank), num_items_in_batch=items(batch)).loss
        (loss * world).backward()  # FSDP averages gradients over the ranks
        first = first or grads(model)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses, trainable(model), first, report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == len(SAMPLE_IMAGES), "one sample (with its images) per rank"
    torch.set_num_threads(1)
    expected = {lora: reference(lora) for lora in (False, True)} if rank == 0 else {}
    dist.barrier()
    mindspeed_hf.enable(config_from_dict({"kernels": {"skip_logits": "always", "loss_chunk_size": 16}}))
    out = {}
    for lora in (False, True):
        losses, params, first, report = sharded(lora, rank, world)
        if rank == 0:
            ref_losses, ref_params, ref_first = expected[lora]
            out["lora" if lora else "full"] = {
                "losses": losses, "ref_losses": ref_losses, "trainable": len(params), "grads": len(first),
                "grad_max_diff": max_diff(first, ref_first), "param_max_diff": max_diff(params, ref_params),
                "kernels": report["kernels"], "vision_kernels": report["vision_kernels"],
            }
    if rank == 0:
        Path(args.out).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
