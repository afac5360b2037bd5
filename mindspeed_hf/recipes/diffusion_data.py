"""The embedded data of the diffusion runs (`mindspeed-hf train --recipe diffusion`, examples/diffusion): cached
latents and text embeddings as diffusers' training scripts keep them with --cache_latents (no VAE, no text encoder,
no download), and the flow-matching step of diffusers' official LoRA scripts.

`classes` prompts, each a fixed random text embedding whose latents are its own smooth pattern (a few low-frequency
waves over the spatial and time axes) plus a little noise: a denoiser can learn each prompt's pattern, so the loss
falls within a few dozen steps.
"""

from __future__ import annotations

from typing import Any

import torch

TEXT_DIM = 32
TEXT_TOKENS = 8
DATA_SEED = 1234


def _patterns(classes: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    axes = torch.meshgrid(*(torch.linspace(0, 3.14, n) for n in shape[1:]), indexing="ij")
    out = []
    for _ in range(classes):
        phase = torch.rand(len(axes), generator=gen) * 6.28
        wave = sum(torch.sin(a * (1 + i) + p) for i, (a, p) in enumerate(zip(axes, phase)))
        out.append(torch.randn(shape[0], *([1] * len(axes)), generator=gen) * wave)
    return torch.stack(out)


def dataset(num_examples: int, latent_shape: tuple[int, ...], classes: int = 4, seed: int = DATA_SEED,
            offset: int = 0) -> list[dict[str, torch.Tensor]]:
    """Rows {latents, prompt_embeds, pooled_prompt_embeds, index}; `offset` draws other rows of the same prompts (a
    held-out split)."""
    gen = torch.Generator().manual_seed(seed)
    patterns = _patterns(classes, latent_shape, seed)
    prompts = torch.randn(classes, TEXT_TOKENS, TEXT_DIM, generator=gen)
    gen.manual_seed(seed + 1 + offset)
    return [{"latents": patterns[i % classes] + 0.05 * torch.randn(latent_shape, generator=gen),
             "prompt_embeds": prompts[i % classes], "pooled_prompt_embeds": prompts[i % classes].mean(0),
             "index": torch.tensor(i)}
            for i in range(num_examples)]


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def noise_scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)


def noisy_latents(latents: torch.Tensor, scheduler: Any, weighting_scheme: str = "logit_normal",
                  logit_mean: float = 0.0, logit_std: float = 1.0, mode_scale: float = 1.29,
                  generator: torch.Generator | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noisy latents, timesteps, target, loss weighting) as the official flow-matching scripts draw them:
    timesteps by compute_density_for_timestep_sampling, sigmas from the scheduler, target = noise - latents."""
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    noise = torch.randn(latents.shape, generator=generator).to(latents.device, latents.dtype)
    u = compute_density_for_timestep_sampling(weighting_scheme, latents.shape[0], logit_mean, logit_std, mode_scale,
                                              generator=generator)
    indices = (u * scheduler.config.num_train_timesteps).long()
    timesteps = scheduler.timesteps[indices].to(latents.device)
    sigmas = scheduler.sigmas.to(latents.device)[indices].float().view(-1, *([1] * (latents.dim() - 1)))
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    return noisy, timesteps, noise - latents, compute_loss_weighting_for_sd3(weighting_scheme, sigmas)


def noisy_latents_per_example(latents: torch.Tensor, indices: torch.Tensor, step: int, seed: int, scheduler: Any,
                              *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`noisy_latents` with each example's noise and timestep drawn from a generator of its own (the seed, the step,
    the example's index): an example gets the same noise however many processes share the batch - what comparing a
    run on several processes with one process needs (a script's global RNG gives every process the same stream)."""
    rows = [noisy_latents(latents[i:i + 1], scheduler, *args,
                          generator=torch.Generator().manual_seed(seed * 1_000_003 + step * 10_007 + int(index)))
            for i, index in enumerate(indices)]
    return tuple(torch.cat(parts) for parts in zip(*rows))


def flow_matching_loss(pred: torch.Tensor, target: torch.Tensor, weighting: torch.Tensor) -> torch.Tensor:
    """The scripts' loss: weighted MSE per sample, averaged."""
    per_sample = (weighting.float() * (pred.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean(1)
    return per_sample.mean()


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/2 * W/2, 4C]: Flux's 2x2 latent patches (its pipeline's _pack_latents)."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, c * 4)


def image_ids(height: int, width: int) -> torch.Tensor:
    """Flux's position ids of the 2x2 patches of a [height, width] latent."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] = torch.arange(height // 2)[:, None]
    ids[..., 2] = torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3)
