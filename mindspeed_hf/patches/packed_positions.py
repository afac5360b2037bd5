"""Packed rows on the Qwen-VL models: per-document M-RoPE positions.

A packed row (mindspeed_hf.data.FlatteningCollator, HF's DataCollatorWithFlattening) carries 2-D text
`position_ids` that restart at every document and no attention mask. HF's Qwen-VL model then expands the text
positions to its three rope rows and attends across documents: the M-RoPE positions of the images are lost, and
(without a text row) HF does not see the packing. This wraps the model's forward (`XModel`, the class that owns
`get_rope_index`): when it gets 2-D position ids, input ids, no attention mask and no filled cache, every
document's three rope rows come from HF's own `get_rope_index` called on that document alone (with its own
images and videos), and HF receives the [4, batch, seq] positions it documents for packing (the text row first),
from which its mask code builds the block-diagonal causal mask (the "mindspeed" attention runs it as packed
sequences: TND on NPU). A document without images or videos keeps its text positions on all three rows, as HF
expands them. Anything else goes to HF's forward untouched.

The Omni thinkers get the same through their XForConditionalGeneration forward (the class every release calls
first; where the positions are computed below it differs by release; the wrapper sits under the head's loss kernel,
multimodal.patch): a document's audio clips are the next ones in order, as many as its audio-start tokens,
their lengths from `feature_attention_mask`. A document without images or videos keeps its text positions, as HF's
Omni rule gives audio tokens consecutive positions.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import masking_utils


def rope_index_owners(module) -> list[type]:
    """The classes of a Qwen-VL modeling module that define `get_rope_index` themselves (XModel)."""
    return [cls for cls in vars(module).values()
            if isinstance(cls, type) and issubclass(cls, nn.Module) and "get_rope_index" in vars(cls)]


def filled(cache: Any) -> bool:
    """A cache that already holds tokens (a continuation, not a fresh forward)."""
    return cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0


def bind(signature: inspect.Signature, *args: Any, **kwargs: Any) -> tuple[inspect.BoundArguments, dict[str, Any]]:
    """HF's forward arguments bound by name, and every argument by name (its **kwargs included)."""
    bound = signature.bind(*args, **kwargs)
    return bound, {**bound.arguments.get("kwargs", {}), **bound.arguments}


def call_by_name(original: Callable, signature: inspect.Signature, bound: inspect.BoundArguments) -> Any:
    """original(self, every other argument by name): HF's decorators (merge_with_config_defaults, ...) may fill in
    keywords themselves, which a positional `use_cache` would then collide with."""
    first, *_ = signature.parameters
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif name != first:
            named[name] = value
    return original(bound.arguments[first], **named)


def without_cache(signature: inspect.Signature, bound: inspect.BoundArguments) -> None:
    """use_cache=False on a bound call: a cache of packed documents means nothing, and HF only finds packed
    documents (its block-diagonal mask) without one."""
    target = bound.arguments if "use_cache" in signature.parameters else bound.arguments.setdefault("kwargs", {})
    target["use_cache"] = False


def _documents(text_positions: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) spans of its documents, split where HF's own packing rule does
    (masking_utils.find_packed_sequence_indices: positions not rising by one)."""
    ids = masking_utils.find_packed_sequence_indices(text_positions)
    if ids is None:
        return [[(0, text_positions.shape[1])] for _ in range(text_positions.shape[0])]
    spans = []
    for row in ids.tolist():
        starts = [i for i, value in enumerate(row) if i == 0 or value != row[i - 1]]
        spans.append(list(zip(starts, [*starts[1:], len(row)])))
    return spans


class _Grids:
    """Hands out the grids (and per-video values) of the images / videos of the next document, in order: a
    document takes grids until their merged token counts add up to its own placeholder tokens."""

    def __init__(self, grids: torch.Tensor | None, merge: int, extra: torch.Tensor | None = None) -> None:
        self.grids, self.extra, self.next = grids, extra, 0
        self.tokens = [] if grids is None else (grids.prod(-1) // merge**2).tolist()

    def take(self, count: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if count == 0:
            return None, None
        first, total = self.next, 0
        while total < count and self.next < len(self.tokens):
            total += self.tokens[self.next]
            self.next += 1
        if total != count:
            given = [] if self.grids is None else self.grids[first:self.next].tolist()
            raise ValueError(f"packed row: a document has {count} image/video tokens, which the next grids "
                             f"({given}) do not add up to")
        extra = None if self.extra is None else self.extra[first:self.next]
        return self.grids[first:self.next], extra


class _Clips:
    """Hands out the frame counts of the next document's audio clips, in order (the Omni thinkers)."""

    def __init__(self, arguments: dict[str, Any]) -> None:
        mask = arguments.get("feature_attention_mask")
        lengths = mask.sum(-1) if isinstance(mask, torch.Tensor) else arguments.get("audio_feature_lengths")
        self.lengths = lengths if arguments.get("input_features") is not None else None
        self.next = 0

    def take(self, count: int) -> torch.Tensor | None:
        if count == 0 or self.lengths is None:
            return None
        if self.next + count > len(self.lengths):
            raise ValueError(f"packed row: a document has {count} audio clips, but only "
                             f"{len(self.lengths) - self.next} of the batch's clips are left")
        self.next += count
        return self.lengths[self.next - count:self.next]


def packed_rope_positions(model: nn.Module, input_ids: torch.Tensor, text_positions: torch.Tensor,
                          arguments: dict[str, Any], spans: list[list[tuple[int, int]]] | None = None) -> torch.Tensor:
    """[4, batch, seq] positions for a packed batch: the text row, then every document's own M-RoPE rows from
    `model.get_rope_index` (HF's) called on that document with its images and videos. `spans`: the documents of
    each row (default: found from `text_positions`)."""
    config = model.config
    merge = config.vision_config.spatial_merge_size
    text_positions = text_positions.expand(input_ids.shape[0], -1)
    spans = _documents(text_positions) if spans is None else spans
    rope = text_positions.unsqueeze(0).repeat(3, 1, 1)
    parameters = inspect.signature(model.get_rope_index).parameters
    token_types = arguments.get("mm_token_type_ids")
    images = _Grids(arguments.get("image_grid_thw"), merge)
    seconds_given = arguments.get("second_per_grid_ts", arguments.get("video_second_per_grid"))
    videos = _Grids(arguments.get("video_grid_thw"), merge, seconds_given)
    clips = _Clips(arguments)
    if "mm_token_type_ids" in parameters and token_types is None:
        # HF's own rule without token types: no M-RoPE (Qwen2.5-VL falls back to the text positions)
        return torch.cat([text_positions.unsqueeze(0), rope])
    # which tokens are image / video placeholders and audio starts, read to the host once (not once per document)
    audio_start = getattr(config, "audio_start_token_id", None) if clips.lengths is not None else None
    image_flags, video_flags, audio_flags = torch.stack([
        input_ids == config.image_token_id, input_ids == config.video_token_id,
        input_ids == (-1 if audio_start is None else audio_start)]).tolist()
    for row, documents in enumerate(spans):
        for start, end in documents:
            ids = input_ids[row:row + 1, start:end]
            image_grids, _ = images.take(sum(image_flags[row][start:end]))
            video_grids, seconds = videos.take(sum(video_flags[row][start:end]))
            audio_lengths = clips.take(sum(audio_flags[row][start:end]))
            if image_grids is None and video_grids is None:
                continue
            given = {"input_ids": ids, "image_grid_thw": image_grids, "video_grid_thw": video_grids,
                     "second_per_grid_ts": seconds, "second_per_grids": seconds,
                     "attention_mask": torch.ones_like(ids),  # the whole document (Qwen3-Omni's rule needs a mask)
                     "audio_seqlens": audio_lengths, "use_audio_in_video": bool(arguments.get("use_audio_in_video")),
                     "mm_token_type_ids": None if token_types is None else token_types[row:row + 1, start:end]}
            positions, _ = model.get_rope_index(**{k: v for k, v in given.items() if k in parameters})
            if positions.is_floating_point() and not rope.is_floating_point():
                rope = rope.to(positions.dtype)  # Qwen3-Omni: fractional video times (seconds x positions per second)
            rope[:, row, start:end] = positions[:, 0].to(rope)
    return torch.cat([text_positions.unsqueeze(0).to(rope.dtype), rope])


def packed_positions_forward(original: Callable) -> Callable:
    """XModel.forward: a packed batch (2-D position ids, input ids, no attention mask, no filled cache) gets its
    per-document [4, batch, seq] positions, and no cache (a cache of packed documents means nothing, and HF only
    builds the packed mask without one); everything else is HF's forward as is."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any):
        bound, arguments = bind(signature, self, *args, **kwargs)
        positions, input_ids = arguments.get("position_ids"), arguments.get("input_ids")
        if (not isinstance(positions, torch.Tensor) or positions.dim() != 2 or input_ids is None
                or arguments.get("attention_mask") is not None
                or filled(arguments.get("cache", arguments.get("past_key_values")))):
            return original(self, *args, **kwargs)
        spans = _documents(positions.expand(input_ids.shape[0], -1))
        bound.arguments["position_ids"] = packed_rope_positions(self, input_ids, positions, arguments, spans)
        if any(len(documents) > 1 for documents in spans):
            without_cache(signature, bound)
        return call_by_name(original, signature, bound)

    forward._mindspeed_packed_positions = True
    return forward


def patch_family(family, module, record: Callable[[Any, str, Any], None]) -> None:
    """Wrap the forward of every class of a Qwen-VL family's module that owns get_rope_index (a VLM entry with
    its own vision tower: qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe; an Omni thinker's heads are wrapped with
    packed_positions_forward under their loss kernel, multimodal.patch). `record(owner, name, value)` is the
    patch engine's recorded setter, so disable() restores HF's forward."""
    if not (family.vlm_heads and family.vision_model) or family.audio_model:  # Omni: inside its heads (multimodal)
        return
    for cls in rope_index_owners(module):
        if not getattr(vars(cls).get("forward"), "_mindspeed_packed_positions", False):
            record(cls, "forward", packed_positions_forward(cls.forward))
