"""torchrun worker for test_recompute_fsdp.py (2 ranks, gloo on CPU). Rank 0 writes a JSON report to --out.

Per case (a tiny Qwen3, plain and with LoRA): one training step under FSDP2 without recompute, then the same step
with each recompute setting. Reported: whether the loss and every local gradient shard are bitwise equal to the
run without recompute, and the largest difference of the gathered gradients from one process (no FSDP, no
recompute) on the same global batch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mindspeed_hf  # noqa: E402
from mindspeed_hf.config import config_from_dict  # noqa: E402
from mindspeed_hf.parallel.dims import ParallelDims, init_distributed  # noqa: E402
from mindspeed_hf.parallel.parallelize import parallelize  # noqa: E402

SETTINGS = {"selective": {"recompute": "selective"},
            "selective_all_parts": {"recompute": "selective",
                                    "recompute_modules": ["self_attn", "mlp", "norms"], "recompute_layers": [1]},
            "full": {"recompute": "full"}}


def build(lora: bool):
    from tiny_models import tiny_model

    model = tiny_model("qwen3")
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.05)
    return model.train()


def batch() -> dict[str, torch.Tensor]:
    """Every token a label, so each rank's mean loss weighs the same as in the global mean."""
    from tiny_models import VOCAB

    ids = torch.randint(1, VOCAB, (4, 17), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids.clone()}


def step(model, data) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**data).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), {n: (g.to_local() if hasattr(g, "to_local") else g).clone() for n, g in grads.items()}


def sharded_run(lora: bool, memory: dict, rank: int, world: int):
    """One step of the FSDP2-sharded model with `memory` settings: (loss, local grad shards, full grads, model)."""
    model = build(lora)
    config = config_from_dict({"memory": memory})
    mindspeed_hf.apply_to_model(model, config)
    dims = ParallelDims(world_size=world)
    dims.build_mesh("cpu")
    model = parallelize(model, dims, config)
    data = {k: v.chunk(world)[rank] for k, v in batch().items()}
    loss, local = step(model, data)
    full = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in model.named_parameters() if p.grad is not None}
    return loss, local, full, model


def all_ranks(flag: bool) -> bool:
    """True when `flag` holds on every rank."""
    flags = torch.tensor([0 if flag else 1])
    dist.all_reduce(flags)
    return int(flags.item()) == 0


def compare_settings(settings: dict[str, dict], extra: Callable[[torch.nn.Module], dict] = lambda model: {}) -> dict:
    """Per case ("plain/<setting>", "lora/<setting>"): bitwise equality with the sharded run without any memory
    setting, the largest difference from one process, the number of gradients, and `extra(model)`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {}
    for lora in (False, True):
        single = build(lora)
        mindspeed_hf.apply_to_model(single, config_from_dict({}))
        _, reference = step(single, batch())
        base_loss, base_local, _, _ = sharded_run(lora, {}, rank, world)
        for name, memory in settings.items():
            loss, local, full, model = sharded_run(lora, memory, rank, world)
            equal = torch.equal(loss, base_loss) and local.keys() == base_local.keys() and all(
                torch.equal(g, base_local[n]) for n, g in local.items())
            report[f"{'lora' if lora else 'plain'}/{name}"] = {
                "bitwise_equal_all_ranks": all_ranks(equal),
                "max_diff_vs_one_process": max((full[n] - reference[n]).abs().max().item() for n in reference),
                "grads": len(local), **extra(model)}
    return report


def main(settings: dict[str, dict] = SETTINGS, extra: Callable[[torch.nn.Module], dict] = lambda model: {}) -> None:
    """Run compare_settings(settings, extra) and write the report to --out (rank 0)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    init_distributed("cpu")
    mindspeed_hf.enable()
    report = compare_settings(settings, extra)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
