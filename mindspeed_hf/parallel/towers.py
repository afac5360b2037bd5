"""Multimodal models on several ranks: every rank runs the same towers each step, whatever media its rows carry.

FSDP2 shards a vision or audio tower like the decoder layers (its blocks, or the whole tower, one group each, as
the model's `_no_split_modules` ask) and gathers a group's weights when it runs, in forward and in backward: a
collective every rank must join. A Qwen-VL or Omni model calls its vision tower for the images and again for the
videos of a batch, and its audio tower for the clips, only when the batch has them. A rank whose micro-batch has
no image would skip collectives another rank runs (gloo fails with "Received data size doesn't match expected
size" deep in the backward, NCCL hangs).

`keep_media_in_step` keeps the ranks in step instead (for the PLACEHOLDER_MODELS; another model with towers stops
in one line when its ranks' media differ): a pre-hook on the model compares which media the local batch
has over the ranks (one small all-gather of three flags) and, for a medium another rank has and this one lacks,
adds a placeholder input of that medium to the forward (one zero image of the smallest grid the tower merges, one
zero video frame, half a window of zero audio frames). HF's own forward then calls the towers in its own order on
every rank; the model's feature method for a placeholder (`get_image_features`, `get_video_features`,
`get_audio_features`) runs the tower and hands the forward the result cut to zero rows, so no placeholder feature
reaches the text (HF's placeholder-token check sees 0 tokens and 0 features) while the backward still runs through
the tower, in HF's order, with zero gradients: the ranks' gradient average is then what data parallelism means for
a rank without that medium.

The same holds for data parallelism we do not shard (trainers/lifecycle.py installs it there too): Trainer's DDP
(with gradient checkpointing it sets find_unused_parameters=False, and a rank that skips a tower never reduces its
gradients: the run hangs), DeepSpeed ZeRO-1/2 (gradient buckets) and ZeRO-3 (weight gathers).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger("mindspeed_hf")

#: The batch keys of the media whose towers a Qwen-VL / Omni forward runs only when they are given, and the model
#: method that turns each into features.
MEDIA = ("input_features", "pixel_values", "pixel_values_videos")
FEATURE_METHODS = {"input_features": "get_audio_features", "pixel_values": "get_image_features",
                   "pixel_values_videos": "get_video_features"}


#: The models whose placeholders are tested (tests/models/test_media_placeholders.py). Another model with towers gets
#: the media comparison and one clear error when its ranks' media differ, where a tower's collectives are at stake.
PLACEHOLDER_MODELS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe",
                      "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker", "llava", "internvl")

#: Where transformers models keep their towers: Qwen-VL's and the Omni thinkers' vision tower, LLaVA's and
#: InternVL's, the Omni audio tower.
TOWERS = ("visual", "vision_tower", "audio_tower")


def tower_modules(model: nn.Module) -> list[nn.Module]:
    """The vision and audio towers (TOWERS) of a transformers model, looked for on it and on its inner `model`; []
    for any other model."""
    found: list[nn.Module] = []
    for owner in _tower_owners(model):
        for name in TOWERS:
            tower = getattr(owner, name, None)
            if isinstance(tower, nn.Module) and all(tower is not t for t in found):
                found.append(tower)
    return found


def _tower_owners(model: nn.Module) -> list[nn.Module]:
    """The modules holding a tower (TOWERS): the model or its inner `model`, whichever forward calls the feature
    methods."""
    return [owner for owner in (model, getattr(model, "model", None))
            if any(isinstance(getattr(owner, name, None), nn.Module) for name in TOWERS)]


def placeholder_media(hf_model: nn.Module, medium: str, device: torch.device) -> dict[str, torch.Tensor]:
    """The forward arguments of one zero input of `medium` for `hf_model`'s tower: the smallest image (or
    one-frame video) grid a Qwen-VL tower merges, one image of a fixed-size tower (LLaVA, InternVL), or half a
    window of mel frames for the audio tower."""
    names = ("audio_tower",) if medium == "input_features" else ("visual", "vision_tower")
    tower = next(t for owner in _tower_owners(hf_model) for t in (getattr(owner, n, None) for n in names) if t)
    config, dtype = tower.config, next(tower.parameters()).dtype
    if medium == "input_features":
        # half a window (the encoders cut clips into windows of 2 * n_window frames): every release's encoder takes
        # it, where 4.57's and 5.6's Qwen3-Omni encoder fails on a whole window of its 2 * 100 frames
        frames = config.n_window
        return {"input_features": torch.zeros(1, config.num_mel_bins, frames, dtype=dtype, device=device),
                "feature_attention_mask": torch.ones(1, frames, dtype=torch.long, device=device)}
    if not hasattr(tower, "patch_embed"):  # a fixed-size tower: one image of its size
        size = config.image_size if isinstance(config.image_size, (list, tuple)) else [config.image_size] * 2
        return {medium: torch.zeros(1, config.num_channels, *size, dtype=dtype, device=device)}
    merge = getattr(tower, "spatial_merge_size", None) or config.spatial_merge_size
    weight = tower.patch_embed.proj.weight  # (its whole shape: a DTensor's, or ZeRO-3's ds_shape when partitioned)
    patch = math.prod(getattr(weight, "ds_shape", weight.shape)[1:])  # channels x temporal patch x patch x patch
    pixels = torch.zeros(merge * merge, patch, dtype=dtype, device=device)
    grid = torch.tensor([[1, merge, merge]], device=device)
    if medium == "pixel_values":
        return {"pixel_values": pixels, "image_grid_thw": grid}
    return {"pixel_values_videos": pixels, "video_grid_thw": grid}


def _no_rows(value: Any) -> Any:
    """`value` (a feature method's result: a tensor, a tuple / list of them, a ModelOutput) with every tensor cut
    to zero rows, still in the autograd graph of what made it."""
    if isinstance(value, torch.Tensor):
        return value[:0] if value.dim() else value
    if isinstance(value, dict):  # ModelOutput
        for key in list(value.keys()):
            value[key] = _no_rows(value[key])
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_no_rows(v) for v in value)
    return value


class _MediaState:
    """Per model: which media this forward carries as placeholders, whether a feature method is running, and how
    many forwards each medium ran as a placeholder (`ran`)."""

    def __init__(self) -> None:
        self.placeholders: set[str] = set()
        self.inside = False
        self.ran: dict[str, int] = dict.fromkeys(MEDIA, 0)


def _feature_method(original: Callable, medium: str, state: _MediaState) -> Callable:
    """`original` (a bound feature method) that, for a placeholder medium, runs and returns zero rows, once. A
    feature method another one calls (Qwen3-VL's videos go through `get_image_features`) is left as it is."""

    def features(*args: Any, **kwargs: Any) -> Any:
        if state.inside:
            return original(*args, **kwargs)
        state.inside = True
        try:
            out = original(*args, **kwargs)
        finally:
            state.inside = False
        if medium not in state.placeholders:
            return out
        state.placeholders.discard(medium)  # one call per medium and forward: a later call is HF's again
        return _no_rows(out)

    return features


def add_placeholders(hf_model: nn.Module, kwargs: dict[str, Any], media: set[str], device: torch.device) -> None:
    """Add to a forward's `kwargs` a placeholder input of each medium in `media` (keys of MEDIA the batch lacks),
    and have `hf_model`'s feature methods cut those media's features to zero rows in this forward."""
    state = getattr(hf_model, "_mindspeed_media_state", None)
    if state is None:
        state = hf_model._mindspeed_media_state = _MediaState()
        for owner in _tower_owners(hf_model):
            for medium, name in FEATURE_METHODS.items():
                if callable(getattr(owner, name, None)):
                    setattr(owner, name, _feature_method(getattr(owner, name), medium, state))
    state.placeholders = set(media)
    for medium in media:
        kwargs.update(placeholder_media(hf_model, medium, device))
        if not state.ran[medium]:
            logger.info("mindspeed_hf: a micro-batch without %s here while another rank has them: its tower runs on "
                        "a zero placeholder (no feature reaches the text; zero gradients), keeping the ranks' "
                        "collectives in step", medium)
        state.ran[medium] += 1


def keep_media_in_step(model: nn.Module, hf_model: nn.Module, device: torch.device,
                       group: dist.ProcessGroup | None = None, gradients_only: bool = False) -> str | None:
    """Install on `model` (what the trainer calls; `hf_model` the transformers model inside it) the per-step media
    sync of the module docstring over `group` (default: all ranks). Once per model. `gradients_only`: only forwards
    that record gradients take part (DDP, ZeRO-1/2, whose only collective is the gradients' reduction), so a
    forward under no_grad (evaluation, a generate on rank 0 alone) stays a one-rank affair. Returns what it
    installed ("placeholders", or "check": a model outside PLACEHOLDER_MODELS), None when nothing."""
    model_type = getattr(hf_model.config, "model_type", None)
    tested = model_type in PLACEHOLDER_MODELS
    if getattr(model, "_mindspeed_media_sync", None) is not None or (gradients_only and not tested):
        return None  # (DDP / ZeRO-1/2 reduce a skipped tower's gradients anyway when told find_unused_parameters)

    def same_media(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if gradients_only and not torch.is_grad_enabled():
            return None
        mine = torch.tensor([kwargs.get(key) is not None for key in MEDIA], dtype=torch.int32, device=device)
        ranks = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(ranks, mine, group=group)
        anywhere = torch.stack(ranks).amax(0).tolist()
        lacking = {key for key, here, there in zip(MEDIA, mine.tolist(), anywhere) if there and not here}
        if not tested and any(not torch.equal(r, mine) for r in ranks):  # every rank stops, the same line
            per_rank = "; ".join(f"rank {i}: {', '.join(k for k, on in zip(MEDIA, r.tolist()) if on) or 'none'}"
                                 for i, r in enumerate(ranks))
            raise ValueError(f"this step's micro-batches carry different media on the ranks ({per_rank}), and "
                             f"{model_type}'s towers have no tested placeholders (tested: "
                             f"{', '.join(PLACEHOLDER_MODELS)}): give every rank's rows the same media each step")
        add_placeholders(hf_model, kwargs, lacking, device)
        return args, kwargs

    def done(module: nn.Module, args: tuple, output: Any) -> None:  # feature methods called later are HF's
        state = getattr(hf_model, "_mindspeed_media_state", None)
        if state is not None:
            state.placeholders = set()

    model._mindspeed_media_sync = (model.register_forward_pre_hook(same_media, with_kwargs=True),
                                   model.register_forward_hook(done, always_call=True))
    return "placeholders" if tested else "check"
