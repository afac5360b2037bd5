"""Shared by the diffusion examples: tiny denoisers built from config, embedded data (cached latents and text
embeddings, as diffusers' scripts keep them with --cache_latents: no VAE, no text encoder, no download), the
flow-matching step of diffusers' official LoRA scripts, and JSON-lines output so runs can be compared.

The data: `classes` prompts, each a fixed random text embedding, each drawing latents of its own smooth pattern
(plus a little noise): the denoiser can learn the pattern of each prompt, so the loss falls within a few steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

TEXT_DIM = 32
TEXT_TOKENS = 8


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
    p.add_argument("--losses_file", default=None, help="write JSON lines here instead of stdout")
    return p


def _patterns(classes: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """One smooth pattern per prompt class: a sum of a few low-frequency waves over the spatial (and time) axes."""
    gen = torch.Generator().manual_seed(seed)
    axes = torch.meshgrid(*(torch.linspace(0, 3.14, n) for n in shape[1:]), indexing="ij")
    out = []
    for _ in range(classes):
        phase = torch.rand(len(axes), generator=gen) * 6.28
        wave = sum(torch.sin(a * (1 + i) + p) for i, (a, p) in enumerate(zip(axes, phase)))
        out.append(torch.randn(shape[0], *([1] * len(axes)), generator=gen) * wave)
    return torch.stack(out)


def dataset(num_examples: int, latent_shape: tuple[int, ...], classes: int = 4, seed: int = 1234) -> list[dict]:
    """Rows {latents, prompt_embeds, pooled_prompt_embeds} of the embedded data."""
    gen = torch.Generator().manual_seed(seed)
    patterns = _patterns(classes, latent_shape, seed)
    prompts = torch.randn(classes, TEXT_TOKENS, TEXT_DIM, generator=gen)
    rows = []
    for i in range(num_examples):
        k = i % classes
        rows.append({"latents": patterns[k] + 0.05 * torch.randn(latent_shape, generator=gen),
                     "prompt_embeds": prompts[k], "pooled_prompt_embeds": prompts[k].mean(0)})
    return rows


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def noise_scheduler() -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)


def noisy_latents(args: argparse.Namespace, scheduler: FlowMatchEulerDiscreteScheduler, latents: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noisy latents, timesteps, target, loss weighting) as the official flow-matching scripts draw them:
    timesteps by compute_density_for_timestep_sampling, sigmas from the scheduler, target = noise - latents."""
    noise = torch.randn_like(latents)
    u = compute_density_for_timestep_sampling(args.weighting_scheme, latents.shape[0], args.logit_mean,
                                              args.logit_std, args.mode_scale)
    indices = (u * scheduler.config.num_train_timesteps).long()
    timesteps = scheduler.timesteps[indices].to(latents.device)
    sigmas = scheduler.sigmas.to(latents.device)[indices].float()
    sigmas = sigmas.view(-1, *([1] * (latents.dim() - 1)))
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    return noisy, timesteps, noise - latents, compute_loss_weighting_for_sd3(args.weighting_scheme, sigmas)


def flow_matching_loss(pred: torch.Tensor, target: torch.Tensor, weighting: torch.Tensor) -> torch.Tensor:
    """The scripts' loss: weighted MSE per sample, averaged."""
    per_sample = (weighting.float() * (pred.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean(1)
    return per_sample.mean()


class JsonLines:
    """Writes one JSON object per line to a file (or stdout)."""

    def __init__(self, path: str | None) -> None:
        self.file = open(path, "w") if path else sys.stdout  # noqa: SIM115  (closed by close())

    def write(self, **fields: Any) -> None:
        self.file.write(json.dumps(fields) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not sys.stdout:
            self.file.close()


def emit_report(out: JsonLines, model: torch.nn.Module) -> None:
    """What the accelerator applied and ran on `model` (kernels all 0 without it)."""
    import mindspeed_hf

    out.write(enabled=mindspeed_hf.is_enabled(), report=mindspeed_hf.report(model))
