"""FlatteningCollator: Hugging Face's `DataCollatorWithFlattening` contract (rows of `input_ids` / `labels` in, one
packed row out, `position_ids` restarting at every row) extended to the vision inputs of the Qwen-VL models.

The text side IS HF's collator (delegated to, with the same options), so `input_ids`, `labels` (the first label of
every row set to `separator_id`), `position_ids`, `cu_seq_lens_*` / `max_length_*` and `seq_idx` follow the
installed release exactly. Added on top, in row order:

- `pixel_values` / `pixel_values_videos`: the rows' patches concatenated along the patch axis;
- `image_grid_thw` / `video_grid_thw`: the rows' grids concatenated along the image (video) axis;
- `second_per_grid_ts` (Qwen2.5-VL videos): concatenated along the video axis;
- `mm_token_type_ids`: concatenated like `input_ids`, shape [1, total];
- `video_second_per_grid` (the Omni models' name for the seconds per video grid): concatenated along the video axis;
- `input_features` / `feature_attention_mask` (the Omni models' audio clips: [clips, mel, frames] and
  [clips, frames] per row, or one clip's [mel, frames] and [frames]): the rows' clips concatenated along the clip
  axis, their frames right-padded with zeros (mask 0) to the longest clip, as a processor pads a batch.

The collator needs no model and no processor. The model side (per-document M-RoPE positions and the
block-diagonal attention) is mindspeed_hf's patch of the Qwen-VL models (patches/packed_positions.py): with
mindspeed_hf enabled, a Qwen-VL model that receives the packed row computes every document's 3-D rope positions
with HF's own `get_rope_index` on that document alone, so a packed batch gives the loss and gradients of the same
rows padded (the Omni thinkers: the same with every document's audio clips). Without mindspeed_hf, HF treats the
packed row as one sequence.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

#: Per-row tensors concatenated along their first axis, in row order.
CONCATENATED = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
                "video_second_per_grid")
#: Per-token rows laid end to end like `input_ids` (shape [1, total]).
PER_TOKEN = ("mm_token_type_ids",)
#: Audio clips of the Omni models: (features [clips, mel, frames], their frame mask [clips, frames]).
AUDIO = ("input_features", "feature_attention_mask")


def _hf_collator_class() -> type:
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening


@dataclass
class FlatteningCollator:
    """Pack a batch of rows into one row without padding, vision inputs included (see the module docstring).

    Each row (feature) is a mapping with a 1-D `input_ids` (list or tensor; a processor's one-example output,
    [1, tokens] text fields, is taken as its row), optionally `labels` (the same length;
    without it the labels are the input ids, as HF does), `mm_token_type_ids` (the same length), and the vision
    tensors of its own images / videos: `pixel_values` [patches, dim], `image_grid_thw` [images, 3],
    `pixel_values_videos`, `video_grid_thw`, `second_per_grid_ts`. Other keys (e.g. `attention_mask`) are dropped,
    as HF's collator drops them. Returns torch tensors.
    """

    #: Return `position_ids` restarting at `position_ids_start` for every row (HF's option). The Qwen-VL models
    #: need them to tell the documents apart: a batch with vision inputs and no position ids is refused.
    return_position_ids: bool = True
    #: The label given to the first token of every row (HF's option): that token is never predicted from the
    #: previous document.
    separator_id: int = -100
    #: Also return `cu_seq_lens_q` / `cu_seq_lens_k` / `max_length_q` / `max_length_k` (HF's option).
    return_flash_attn_kwargs: bool = False
    #: Also return `seq_idx`, the row index of every token (HF's option).
    return_seq_idx: bool = False
    #: The position of every row's first token (HF's option, transformers >= 5; 0 on every release).
    position_ids_start: int = 0
    _text: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        hf = _hf_collator_class()
        options = dict(return_position_ids=self.return_position_ids, separator_id=self.separator_id,
                       return_flash_attn_kwargs=self.return_flash_attn_kwargs, return_seq_idx=self.return_seq_idx)
        if self.position_ids_start:
            if "position_ids_start" not in inspect.signature(hf.__init__).parameters:
                import transformers

                raise ValueError(f"FlatteningCollator: position_ids_start={self.position_ids_start} needs a "
                                 f"transformers release whose DataCollatorWithFlattening has it (>= 5); "
                                 f"{transformers.__version__} has not")
            options["position_ids_start"] = self.position_ids_start
        self._text = hf(return_tensors="pt", **options)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """One packed row: HF's flattened text fields, then the vision fields of the rows in row order."""
        rows = [_one_row(row, index) for index, row in enumerate(features)]
        rows = [row for row in rows if len(row["input_ids"]) > 0]  # HF's collator skips empty rows too
        batch = self._text(rows)
        for key in PER_TOKEN:
            present = [row.get(key) is not None for row in rows]
            if any(present):
                if not all(present):
                    raise ValueError(f"FlatteningCollator: {key} is given for some rows but not for others")
                batch[key] = torch.cat([_tensor(row[key]).reshape(-1) for row in rows]).unsqueeze(0)
        for key in CONCATENATED:
            parts = [_tensor(row[key]) for row in rows if row.get(key) is not None]
            if parts:
                batch[key] = torch.cat(parts)
        batch.update(pad_audio_clips(rows))
        vision = any(key in batch for key in ("pixel_values", "pixel_values_videos", "input_features"))
        if vision and not self.return_position_ids:
            raise ValueError("FlatteningCollator: return_position_ids=False with vision inputs: the model could not "
                             "tell the documents apart (their M-RoPE positions restart per document)")
        return batch


def pad_audio_clips(rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """The rows' audio clips in row order, as a processor pads a batch: `input_features` [clips, mel, frames] and
    `feature_attention_mask` [clips, frames], frames right-padded to the longest clip (features 0, mask 0); each
    row gives both fields ([clips, mel, frames] and [clips, frames], or one clip's [mel, frames] and [frames]) or
    neither. {} when no row has audio."""
    features, masks = [], []
    for index, row in enumerate(rows):
        given = [row.get(key) is not None for key in AUDIO]
        if any(given) and not all(given):
            raise ValueError(f"FlatteningCollator: row {index} has {AUDIO[given.index(True)]} without "
                             f"{AUDIO[given.index(False)]}; an audio clip needs both")
        if all(given):
            clips, mask = _tensor(row[AUDIO[0]]), _tensor(row[AUDIO[1]])
            clips, mask = (clips[None], mask[None]) if clips.dim() == 2 else (clips, mask)
            if clips.dim() != 3 or mask.shape != (clips.shape[0], clips.shape[2]):
                raise ValueError(f"FlatteningCollator: row {index}: input_features {list(clips.shape)} and "
                                 f"feature_attention_mask {list(mask.shape)} must be [clips, mel, frames] and "
                                 "[clips, frames]")
            features.append(clips)
            masks.append(mask)
    if not features:
        return {}
    frames = max(clips.shape[-1] for clips in features)
    return {AUDIO[0]: torch.cat([torch.nn.functional.pad(clips, (0, frames - clips.shape[-1])) for clips in features]),
            AUDIO[1]: torch.cat([torch.nn.functional.pad(mask, (0, frames - mask.shape[-1])) for mask in masks])}


def _one_row(row: Mapping[str, Any], index: int) -> Mapping[str, Any]:
    """`row` with its text fields 1-D: a processor called on one example returns them [1, tokens]."""
    ids = row["input_ids"]
    if not isinstance(ids, torch.Tensor) and not (len(ids) and isinstance(ids[0], (list, tuple))):
        return row
    ids = _tensor(ids)
    if ids.dim() == 1:
        return row
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"FlatteningCollator: row {index}: input_ids of shape {list(ids.shape)}; each feature is one "
                         "row: [tokens], or a processor's one-example [1, tokens]")
    text = ("input_ids", "labels", "attention_mask", *PER_TOKEN)
    return {**row, **{key: _tensor(row[key]).reshape(-1).tolist() for key in text if row.get(key) is not None}}


def _tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
