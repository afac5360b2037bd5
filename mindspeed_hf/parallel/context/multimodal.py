"""Context parallelism through vision-language models (and the Omni thinkers: audio merged in the same way): the
sequence is split inside the model, after the vision and audio features are merged into the text.

A multimodal batch cannot be split before the model: a rank would hold part of an image's placeholder tokens but
all of its features. Under cp a vision-language model therefore gets the whole batch (split_cp_batch leaves
`input_ids`, the mask, the position ids and the vision inputs whole, and hands over this rank's slice of the
globally shifted labels and the `segment_ids`); the vision tower runs on every image once per step, HF merges the
features and computes the 3-D rope positions for the whole sequence, and a forward pre-hook on the language model
then takes this rank's slice of everything that is per token, with the text splitter's own indices
(split.shard_indices, the tail padded as there):

- `inputs_embeds` (the merged embeddings), `position_ids` (M-RoPE's 3 or 4 rows, or 1-D positions, made global
  first when HF leaves them to the text model), `cache_position`;
- Qwen3-VL's deepstack inputs: `visual_pos_masks` and, per layer, the features of the visual tokens that fall in
  this rank's slice;
- the attention mask is dropped: `segment_ids` carries left padding and packed documents to the cp attention.

The text layers, the head and the loss then run on the slice exactly as for a text model (model.py).

With `parallel.cp_vision` the vision tower is shared instead of repeated (share_vision): every cp rank runs it on
its share of the frames (an image is one frame; a video's temporal patches are frames: the Qwen-VL towers attend,
merge and place their rope within a frame, so one long video splits too), consecutive and balanced by patches (a
batch with fewer frames than cp ranks runs whole on every rank), and one all-gather hands every rank the merged
features of all of them (and Qwen3-VL's deepstack features) in order. Its backward sums each frame's feature
gradient over the ranks (every rank's text slice may read every frame), so with FSDP2's average over cp the
tower's gradients are one process's.
The tower's `last_hidden_state` (patch-level, before the merger) stays this rank's share: HF's Qwen-VL models read
only the merged outputs.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .split import padded_length, shard_indices

SPLIT_MARK = "segment_ids"  # always present (maybe None) in a split batch: the hook slices only then


def language_model_of(hf_model: nn.Module) -> nn.Module | None:
    """The text decoder a vision-language model calls with the merged embeddings (`model.language_model`)."""
    inner = getattr(hf_model, "model", hf_model)
    language = getattr(inner, "language_model", None)
    return language if isinstance(language, nn.Module) else None


def _pad_tail(x: torch.Tensor, length: int, dim: int, value: Any) -> torch.Tensor:
    extra = length - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def _positions(positions: torch.Tensor | None, batch: int, seq: int, length: int, device) -> torch.Tensor:
    """Global positions over the padded length (the tail keeps counting, as split.py does), any leading rows."""
    if positions is None:
        return torch.arange(length, device=device).expand(batch, length)
    tail = positions[..., -1:] + torch.arange(1, length - seq + 1, device=positions.device)
    return torch.cat([positions, tail], dim=-1)


def _deepstack(mask: torch.Tensor, features: list[torch.Tensor] | None, length: int,
               idx: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """This rank's `visual_pos_masks` and the rows of each deepstack feature tensor for the visual tokens in it
    (the features are in row-major order of the global mask)."""
    full = _pad_tail(mask, length, 1, False)
    local = full[:, idx]
    if not features:
        return local, features
    order = (full.reshape(-1).long().cumsum(0) - 1).view_as(full)[:, idx][local]
    return local, [f[order] for f in features]


def make_slice_hook(cp: int, rank: int, zigzag: bool, ulysses: int):
    """The forward pre-hook (with kwargs) that hands the language model this rank's slice (module docstring)."""

    def slice_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if SPLIT_MARK not in kwargs:
            return None  # not a split batch: the cp attention says so, in one line
        embeds = kwargs.get("inputs_embeds")
        if args or embeds is None:
            raise ValueError("parallel.cp: the vision-language model called its language model without "
                             "`inputs_embeds` (keyword); this model's forward cannot be split inside")
        batch, seq = embeds.shape[:2]
        length = padded_length(seq, cp, zigzag)
        idx = shard_indices(length, cp, rank, zigzag, ulysses).to(embeds.device)
        kwargs["inputs_embeds"] = _pad_tail(embeds, length, 1, 0)[:, idx]
        kwargs["position_ids"] = _positions(kwargs.get("position_ids"), batch, seq, length, embeds.device)[..., idx]
        kwargs["attention_mask"] = None
        if isinstance(kwargs.get("cache_position"), torch.Tensor):
            kwargs["cache_position"] = torch.arange(length, device=embeds.device)[idx]
        if isinstance(kwargs.get("visual_pos_masks"), torch.Tensor):
            kwargs["visual_pos_masks"], kwargs["deepstack_visual_embeds"] = _deepstack(
                kwargs["visual_pos_masks"], kwargs.get("deepstack_visual_embeds"), length, idx)
        return args, kwargs

    return slice_inputs


def split_inside(hf_model: nn.Module, cp: int, rank: int, zigzag: bool, ulysses: int) -> nn.Module:
    """Install the slicing hook on `hf_model`'s language model (once) and return that language model."""
    language = language_model_of(hf_model)
    if language is None:
        raise ValueError(f"parallel.cp: {hf_model.config.model_type} has no `model.language_model` to split the "
                         "sequence in; valid choices: parallel.cp=1")
    previous = getattr(language, "_mindspeed_cp_slice", None)
    if previous is not None:
        previous.remove()
    language._mindspeed_cp_slice = language.register_forward_pre_hook(make_slice_hook(cp, rank, zigzag, ulysses),
                                                                      with_kwargs=True)
    return language


# ------------------------------------------------------------------------------------------- cp_vision


def vision_tower_of(hf_model: nn.Module) -> nn.Module | None:
    """A Qwen-VL vision tower (`model.visual`: patches and `grid_thw` in, merged features out), or None."""
    visual = getattr(getattr(hf_model, "model", hf_model), "visual", None)
    return visual if isinstance(visual, nn.Module) and hasattr(visual, "spatial_merge_size") else None


def frame_shares(patches: list[int], ranks: int) -> list[tuple[int, int]] | None:
    """Consecutive frame ranges [start, end) per rank, balanced by patch count, each non-empty; None when there
    are fewer frames than ranks."""
    if len(patches) < ranks:
        return None
    ends = list(itertools.accumulate(patches))
    cuts = [0]
    for rank in range(1, ranks):
        cut = bisect.bisect_left(ends, ends[-1] * rank / ranks) + 1
        cuts.append(min(max(cut, cuts[-1] + 1), len(patches) - (ranks - rank)))
    cuts.append(len(patches))
    return list(zip(cuts, cuts[1:]))


def _frames(grids: torch.Tensor) -> torch.Tensor:
    """[items, 3] (t, h, w) grids -> one (1, h, w) row per frame, in the patches' order (frame-major)."""
    frames = grids.repeat_interleave(grids[:, 0], dim=0).clone()
    frames[:, 0] = 1
    return frames


class _GatherFrames(torch.autograd.Function):
    """This rank's rows -> every rank's, in rank order (`sizes` rows each); backward: this rank's rows of the
    gradient summed over the group."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, sizes: list[int], rank: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.sizes, ctx.rank, ctx.group = sizes, rank, group
        padded = local.new_zeros(max(sizes), *local.shape[1:])
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start:start + ctx.sizes[ctx.rank]], None, None, None


def _share_inputs(group: dist.ProcessGroup):
    """Forward pre-hook of the vision tower: keep this rank's frames (their patch rows, one (1, h, w) grid each)."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)

    def keep_mine(module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        module._mindspeed_cp_share = None
        grids = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        if not args or not isinstance(grids, torch.Tensor):
            return None
        frames = _frames(grids)
        patches = frames.prod(-1).tolist()
        shares = frame_shares(patches, ranks)
        if shares is None:
            return None
        merged = [n // module.spatial_merge_size**2 for n in patches]
        start, end = shares[rank]
        rows = slice(sum(patches[:start]), sum(patches[:end]))
        module._mindspeed_cp_share = ([sum(merged[a:b]) for a, b in shares], rank, group)
        args = (args[0][rows], *(() if "grid_thw" in kwargs else (frames[start:end],)), *args[2:])
        if "grid_thw" in kwargs:
            kwargs["grid_thw"] = frames[start:end]
        return args, kwargs

    return keep_mine


def _gather_outputs(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
    """Forward hook of the vision tower: every rank's merged features (and deepstack features), in order."""
    share = module.__dict__.pop("_mindspeed_cp_share", None)
    if share is None:
        return None
    module._mindspeed_cp_vision["shared"] += 1

    def gather(rows: torch.Tensor) -> torch.Tensor:
        return _GatherFrames.apply(rows, *share)

    if isinstance(output, torch.Tensor):  # transformers 4.57: the merged features
        return gather(output)
    if isinstance(output, tuple):  # 4.57's Qwen3-VL: (merged features, [deepstack features])
        merged, *rest = output
        return (gather(merged), *([gather(f) for f in part] if isinstance(part, list) else part for part in rest))
    output.pooler_output = gather(output.pooler_output)
    if getattr(output, "deepstack_features", None):
        output.deepstack_features = [gather(f) for f in output.deepstack_features]
    return output


def share_vision(hf_model: nn.Module, group: dist.ProcessGroup) -> None:
    """Share `hf_model`'s vision tower over `group` (the cp ranks): see the module docstring. Once per model."""
    visual = vision_tower_of(hf_model)
    if visual is None or getattr(visual, "_mindspeed_cp_vision", None) is not None:
        return
    visual._mindspeed_cp_vision = {
        "hooks": (visual.register_forward_pre_hook(_share_inputs(group), with_kwargs=True),
                  visual.register_forward_hook(_gather_outputs, with_kwargs=True)),
        "shared": 0,  # forwards whose images were shared (the others ran whole on every rank)
    }
