"""Multimodal models under FSDP2: every rank must run the same towers each step, or the run stops in one line.

FSDP2 shards a vision or audio tower like the decoder layers (its blocks, or the whole tower, one group each, as
the model's `_no_split_modules` ask) and gathers a group's weights when it runs, in forward and in backward: a
collective every rank must join. A Qwen-VL or Omni model calls its vision tower for the images and again for the
videos of a batch, and its audio tower for the clips, only when the batch has them. A rank whose micro-batch has
no image therefore skips collectives another rank runs: gloo fails with "Received data size doesn't match expected
size" deep in the backward, NCCL hangs.

`check_media_per_step` turns that into one clear error before the forward: a pre-hook on the model takes which
media the local batch has, compares them over the ranks (one small all-gather), and when they differ every rank
raises the same ValueError, naming the step's media per rank and what to do. (Keeping every rank in step instead,
with tower calls on zero inputs where a rank lacks a medium, also needs the embeddings' and the towers' backward
collectives in one order on every rank: not done yet.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

#: The batch keys of the media whose towers a Qwen-VL / Omni forward runs only when they are given.
MEDIA = ("input_features", "pixel_values", "pixel_values_videos")


def tower_modules(model: nn.Module) -> list[nn.Module]:
    """The vision tower (`visual`) and the Omni audio tower (`audio_tower`) of a transformers model, looked for on
    it and on its inner `model`; [] for any other model."""
    found: list[nn.Module] = []
    for owner in (model, getattr(model, "model", None)):
        for name in ("visual", "audio_tower"):
            tower = getattr(owner, name, None)
            if isinstance(tower, nn.Module) and all(tower is not t for t in found):
                found.append(tower)
    return found


def check_media_per_step(model: nn.Module, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
    """Install on `model` (what the trainer calls) the per-step check of the module docstring over `group`
    (default: all ranks). Once per model."""
    if getattr(model, "_mindspeed_media_check", None) is not None:
        return

    def same_media(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        mine = torch.tensor([kwargs.get(key) is not None for key in MEDIA], dtype=torch.int32, device=device)
        ranks = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(ranks, mine, group=group)
        if any(not torch.equal(r, ranks[0]) for r in ranks):
            per_rank = "; ".join(f"rank {i}: {', '.join(k for k, on in zip(MEDIA, r.tolist()) if on) or 'none'}"
                                 for i, r in enumerate(ranks))
            raise ValueError(f"parallel.dp_shard: this step's micro-batches carry different media on the ranks "
                             f"({per_rank}); under FSDP2 every rank must run the same towers each step: give every "
                             "row the same media (e.g. group rows by media), or train with parallel.dp_shard=1")

    model._mindspeed_media_check = model.register_forward_pre_hook(same_media, with_kwargs=True)
