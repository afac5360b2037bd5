"""torchrun worker (2 ranks, gloo): QLoRA under FSDP2 against plain HF QLoRA in one process on the same global batch.

Every rank first runs the plain reference (MINDSPEED_HF_AUTO=0: nothing patched yet) on the whole batch; then, with
the accelerator on (the fused loss too), the same model sharded by apply_fsdp, each rank on its half. Per storage
(bnb_4bit_quant_storage uint8 and float32): per-step losses and LoRA gradients, the base weights' placement, and the
adapter-only consolidated save. Then the refusal of bf16 mixed precision over a float32 storage. Rank 0 writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models, qlora_models
from qlora_models import qlora_model, save_base, step_batch  # noqa: E402

import mindspeed_hf  # noqa: E402
from mindspeed_hf.config import config_from_dict  # noqa: E402
from mindspeed_hf.parallel.checkpoint import save_hf_consolidated  # noqa: E402
from mindspeed_hf.parallel.fsdp import apply_fsdp  # noqa: E402

STEPS, LR, GLOBAL_BATCH = 3, 1e-2, 4


def _items(labels: torch.Tensor) -> torch.Tensor:
    return (labels[:, 1:] != -100).sum()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _lora(model, grads: bool = False) -> dict[str, torch.Tensor]:
    return {n: _full(p.grad if grads else p) for n, p in model.named_parameters() if p.requires_grad}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a, sorted(set(a) ^ set(b))[:4]
    return max((a[k] - b[k]).abs().max().item() for k in a)


def run(model, rank: int, world: int) -> tuple[list[float], list[dict]]:
    """STEPS AdamW steps; with world > 1 this rank takes its share of the global batch (FSDP averages the
    gradients over the ranks, so the loss is scaled back by the world size)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    per = GLOBAL_BATCH // world
    losses, grads = [], []
    for step in range(STEPS):
        batch = step_batch(step, batch=GLOBAL_BATCH)
        n = _items(batch["labels"])
        mine = {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}
        loss = model(**mine, num_items_in_batch=n).loss
        (loss * world).backward()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item())
        grads.append(_lora(model, grads=True))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, grads


def placements(model, storage: torch.dtype) -> dict:
    """The packed 4-bit weights: all sharded on dim 0, in the storage dtype, each rank holding its part."""
    packed = [p for n, p in model.named_parameters() if n.endswith("base_layer.weight")]
    return {
        "count": len(packed),
        "sharded": all(isinstance(p, DTensor) and str(p.placements) == "(Shard(dim=0),)" for p in packed),
        "dtype": sorted({str(p.dtype) for p in packed}) == [str(storage)],
        "local_fraction": sum(p.to_local().numel() for p in packed) / sum(p.numel() for p in packed),
    }


def sharded_case(base: str, root: Path, storage: torch.dtype, reference: tuple, ref_params: dict, rank: int,
                 world: int, mesh) -> dict:
    model = qlora_model(base, quant_storage=storage)
    report = mindspeed_hf.apply_to_model(model)
    apply_fsdp(model, mesh)
    losses, grads = run(model, rank, world)
    out = {
        "losses": losses, "ref_losses": reference[0],
        "grad_max_diff": max(_max_diff(g, r) for g, r in zip(grads, reference[1])),
        "placements": placements(model, storage),
        "fused_loss": report["kernels"]["fused_linear_cross_entropy"],
        "quantized_linear": report["quantized_linear"],
    }
    trained = _lora(model)
    out["param_max_diff"] = _max_diff(trained, ref_params)
    saved = root / f"adapter_{str(storage).removeprefix('torch.')}"
    save_hf_consolidated(model, str(saved))
    if rank == 0:
        from safetensors.torch import load_file

        state = load_file(saved / "adapter_model.safetensors")
        out["saved_files"] = sorted(p.name for p in saved.iterdir())
        out["saved_only_lora"] = bool(state) and all("lora_" in k for k in state)
        # PEFT's file drops the adapter name: ...lora_A.weight for the model's ...lora_A.default.weight
        out["saved_max_diff"] = max((state[k.replace(".default", "")] - v).abs().max().item()
                                    for k, v in trained.items())
    return out


def refusal(base: str, mesh) -> dict:
    model = qlora_model(base, quant_storage=torch.float32, gradient_checkpointing=False)
    try:
        apply_fsdp(model, mesh, param_dtype=torch.bfloat16)
        message = "no error"
    except ValueError as err:
        message = str(err)
    return {"message": message, "untouched": not any(isinstance(p, DTensor) for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(args.root)
    base = str(root / "base")
    if rank == 0:
        save_base(base)
    dist.barrier()

    assert not mindspeed_hf.is_enabled()
    ref_model = qlora_model(base)
    reference = run(ref_model, 0, 1)  # plain HF, one process, the whole batch
    ref_params = _lora(ref_model)
    del ref_model

    mindspeed_hf.enable(config_from_dict({"kernels": {"skip_logits": "always"}}))
    mesh = init_device_mesh("cpu", (world,))
    out = {str(s).removeprefix("torch."): sharded_case(base, root, s, reference, ref_params, rank, world, mesh)
           for s in (torch.uint8, torch.float32)}
    out["refusal"] = refusal(base, mesh)
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
