"""Shared by the diffusion examples: their options, the embedded data and flow-matching step (shipped with
mindspeed_hf for `mindspeed-hf train --recipe diffusion`: mindspeed_hf/recipes/diffusion_data.py), and JSON-lines output
so runs can be compared. Nothing here is needed by mindspeed_hf itself; a real script loads its own data."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

from mindspeed_hf.recipes import diffusion_data as data
from mindspeed_hf.recipes.diffusion_data import (  # noqa: F401  (the scripts use them as tiny.NAME)
    TEXT_DIM,
    TEXT_TOKENS,
    collate,
    dataset,
    flow_matching_loss,
    image_ids,
    noise_scheduler,
    pack,
)


def arguments(description: str, steps: int = 30) -> argparse.ArgumentParser:
    """The options diffusers' LoRA scripts have that these runs use (same names)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--max_train_steps", type=int, default=steps)
    p.add_argument("--train_batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=1e-2)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mixed_precision", choices=("no", "fp16", "bf16"), default="no")
    p.add_argument("--weighting_scheme", choices=("sigma_sqrt", "logit_normal", "mode", "cosmap", "none"),
                   default="logit_normal")
    p.add_argument("--logit_mean", type=float, default=0.0)
    p.add_argument("--logit_std", type=float, default=1.0)
    p.add_argument("--mode_scale", type=float, default=1.29)
    p.add_argument("--num_examples", type=int, default=32)
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--noise_per_example", action="store_true",
                   help="draw each example's noise and timestep from its own generator (seed, step, example index), so "
                   "any number of processes draws the same noise for an example (to compare runs)")
    p.add_argument("--losses_file", default=None, help="write JSON lines here instead of stdout")
    return p


def noisy_latents(args: argparse.Namespace, scheduler: Any, latents: torch.Tensor, indices: torch.Tensor,
                  step: int):
    """(noisy latents, timesteps, target, loss weighting) with the script's weighting options."""
    options = (args.weighting_scheme, args.logit_mean, args.logit_std, args.mode_scale)
    if args.noise_per_example:
        return data.noisy_latents_per_example(latents, indices, step, args.seed, scheduler, *options)
    return data.noisy_latents(latents, scheduler, *options)


class JsonLines:
    """Writes one JSON object per line to a file (or stdout); under several processes the main one writes."""

    def __init__(self, path: str | None) -> None:
        main = os.environ.get("RANK", "0") == "0"
        self.file = (open(path, "w") if path else sys.stdout) if main else None  # noqa: SIM115  (close())

    def write(self, **fields: Any) -> None:
        if self.file is not None:
            self.file.write(json.dumps(fields) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file not in (None, sys.stdout):
            self.file.close()


def emit_report(out: JsonLines, model: torch.nn.Module) -> None:
    """What the accelerator applied and ran on `model` (kernels all 0 without it)."""
    import mindspeed_hf

    out.write(enabled=mindspeed_hf.is_enabled(), report=mindspeed_hf.report(model))
