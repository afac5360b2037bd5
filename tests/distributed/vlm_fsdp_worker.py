"""torchrun worker (gloo, 2 ranks): a tiny Qwen2.5-VL under FSDP2 with mindspeed_hf (fused loss, varlen vision
attention, vision RMSNorm / SwiGLU / rope) against plain HF in one process, for a full fine-tune and for LoRA on the
language model with the vision tower frozen; and LLaVA / InternVL (fixed-size towers) with rank 0's sample carrying
images and rank 1's none (mindspeed_hf's media sync gives rank 1 a placeholder image). Rank 0 writes a JSON report
to --out."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_vlms

from tiny_vlms import GRIDS, IMAGE, SAMPLE_IMAGES, tiny_vlm, vlm_batch  # noqa: E402

import mindspeed_hf  # noqa: E402
from mindspeed_hf.config import config_from_dict  # noqa: E402
from mindspeed_hf.parallel.dims import ParallelDims, fsdp_mesh, init_distributed  # noqa: E402
from mindspeed_hf.parallel.fsdp import apply_fsdp  # noqa: E402
from mindspeed_hf.parallel.towers import keep_media_in_step  # noqa: E402

STEPS, LR = 2, 0.1  # SGD: weights move by LR x gradient, so a gradient difference shows as is
# case: (model type, LoRA); LLaVA and InternVL with rank 1's sample text only (batches())
CASES = {"full": ("qwen2_5_vl", False), "lora": ("qwen2_5_vl", True), "llava": ("llava", False),
         "internvl": ("internvl", False)}


def build(lora: bool, model_type: str = "qwen2_5_vl"):
    model = tiny_vlm(model_type)
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
    batches = [vlm_batch(model, left=bool(step % 2), seed=10 + step) for step in range(STEPS)]
    if model.config.model_type in ("llava", "internvl"):  # sample 1 text only: its images' tokens become text
        for batch in batches:
            images = batch["input_ids"][1] == IMAGE
            batch["input_ids"][1, images] = 7
            batch["labels"][1, images] = 7
            batch["pixel_values"] = batch["pixel_values"][list(SAMPLE_IMAGES[0])]
    return batches


def rank_share(batch: dict, rank: int) -> dict:
    """Sample `rank` of the batch with its own images (pixel rows and grids)."""
    sizes = [t * h * w for t, h, w in GRIDS]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    images = SAMPLE_IMAGES[rank]
    rows = torch.cat([torch.arange(starts[i], starts[i] + sizes[i]) for i in images])
    share = {k: v[rank:rank + 1] for k, v in batch.items() if k not in ("pixel_values", "image_grid_thw")}
    if "image_grid_thw" not in batch:  # LLaVA / InternVL: whole images, all of them sample 0's
        if rank == 0:
            share["pixel_values"] = batch["pixel_values"]
        return share
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


def reference(lora: bool, model_type: str = "qwen2_5_vl") -> tuple[list[float], dict]:
    model = build(lora, model_type)
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


def sharded(lora: bool, rank: int, world: int, model_type: str = "qwen2_5_vl") -> tuple[list[float], dict, dict, dict]:
    model = build(lora, model_type)
    report = mindspeed_hf.apply_to_model(model)
    dims = ParallelDims(world_size=world)
    apply_fsdp(model, fsdp_mesh(dims.build_mesh("cpu"), dims))
    keep_media_in_step(model, model, torch.device("cpu"))  # what parallelize adds for a model with towers
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
    state = getattr(model, "_mindspeed_media_state", None)  # placeholder passes, summed over the ranks
    placeholders = torch.tensor(sum(state.ran.values()) if state else 0)
    dist.all_reduce(placeholders)
    return losses, trainable(model), first, {**report, "placeholders": placeholders.item()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == len(SAMPLE_IMAGES), "one sample (with its images) per rank"
    torch.set_num_threads(1)
    expected = {case: reference(lora, model_type) for case, (model_type, lora) in CASES.items()} if rank == 0 else {}
    dist.barrier()
    mindspeed_hf.enable(config_from_dict({"kernels": {"skip_logits": "always", "loss_chunk_size": 16}}))
    out = {}
    for case, (model_type, lora) in CASES.items():
        losses, params, first, report = sharded(lora, rank, world, model_type)
        if rank == 0:
            ref_losses, ref_params, ref_first = expected[case]
            out[case] = {
                "losses": losses, "ref_losses": ref_losses, "trainable": len(params), "grads": len(first),
                "grad_max_diff": max_diff(first, ref_first), "param_max_diff": max_diff(params, ref_params),
                "kernels": report["kernels"], "vision_kernels": report.get("vision_kernels"),
                "placeholders": report["placeholders"],
            }
    if rank == 0:
        Path(args.out).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
