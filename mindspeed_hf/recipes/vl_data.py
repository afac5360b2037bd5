"""Synthetic vision-language data for `mindspeed-hf train --recipe vl`, the VLM example and the VLM benchmark.

Each example is a small RGB image with one coloured shape in one quadrant, and a question about it ("what colour
is the shape ?" -> "red", "where is the shape ?" -> "top left"; the shape itself, a square, circle or cross, varies
as a distractor: a model this small does not learn to name it within the recipe's budget). Images become
Qwen-VL patch rows here, without a processor: the same layout, rescaling and normalisation as transformers'
Qwen2VLImageProcessor (tested against it), so the data runs on any Qwen2-VL / Qwen2.5-VL / Qwen3-VL model.

`VLCollator` pads a batch and carries `mm_token_type_ids` (3-D M-RoPE positions need it: Qwen2.5-VL silently falls
back to 1-D positions without it), `pixel_values` (all images' patch rows, concatenated) and `image_grid_thw`;
labels are -100 on the prompt, the image and vision-special tokens and the padding.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .data import IGNORE_INDEX

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 230), "yellow": (235, 215, 40)}
SHAPES = ("square", "circle", "cross")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
QUESTIONS = {"colour": "what colour is the shape ?", "where": "where is the shape ?"}
# Qwen-VL's special tokens, spelled as its tokenizer does, so a Qwen processor recognises them.
VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
SPECIALS = ("<pad>", "<unk>", "<bos>", "<eos>", VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD)
# CLIP normalisation, as Qwen2VLImageProcessor applies it after rescaling to [0, 1].
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class PatchLayout:
    """How a Qwen-VL vision tower cuts images: `patch_size` pixels, `temporal_patch_size` frames per patch (a still
    image is repeated), `merge_size` x `merge_size` patches merged into one text token."""

    patch_size: int = 4
    temporal_patch_size: int = 2
    merge_size: int = 2

    @classmethod
    def of(cls, vision_config: Any) -> PatchLayout:
        """The layout of a model's vision config."""
        return cls(vision_config.patch_size, vision_config.temporal_patch_size, vision_config.spatial_merge_size)

    def tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """Text tokens one image of this grid takes (after the merger)."""
        t, h, w = grid_thw
        return t * h * w // self.merge_size**2


def words(specials: Sequence[str] = SPECIALS, texts: Iterable[str] | None = None) -> list[str]:
    """The word-level vocabulary: `specials` first, then every word of `texts` (default: the questions and answers
    of the VL data)."""
    vocab = [*specials]
    for text in (texts if texts is not None else (*QUESTIONS.values(), *COLOURS, *POSITIONS)):
        vocab += [w for w in text.split() if w not in vocab]
    return vocab


def make_tokenizer(specials: Sequence[str] = SPECIALS, texts: Iterable[str] | None = None) -> Any:
    """A whitespace word-level tokenizer (PreTrainedTokenizerFast) over `words(specials, texts)`; saved with the
    checkpoint. `specials` start with pad, unk, bos and eos; the rest are its additional special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words(specials, texts))},
                                         unk_token=specials[1]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    pad, unk, bos, eos, *extra = specials
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad, unk_token=unk, bos_token=bos,
                                   eos_token=eos, additional_special_tokens=extra)


def draw(colour: str, shape: str, position: str, size: int, rng: random.Random) -> torch.Tensor:
    """A (3, size, size) uint8 image: grey noise, one `shape` in `colour` somewhere inside the `position` quadrant."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    image = torch.randint(90, 130, (3, size, size), generator=gen, dtype=torch.int64)
    half = size // 2
    radius = max(2, size // 7)
    top = (half if position.startswith("bottom") else 0) + rng.randint(radius, half - radius - 1)
    left = (half if position.endswith("right") else 0) + rng.randint(radius, half - radius - 1)
    ys, xs = torch.meshgrid(torch.arange(size) - top, torch.arange(size) - left, indexing="ij")
    if shape == "square":
        mask = (ys.abs() <= radius) & (xs.abs() <= radius)
    elif shape == "circle":
        mask = ys**2 + xs**2 <= radius**2
    else:  # cross
        mask = ((ys.abs() <= radius) & (xs.abs() <= radius // 3)) | ((xs.abs() <= radius) & (ys.abs() <= radius // 3))
    image[:, mask] = torch.tensor(COLOURS[colour]).unsqueeze(1)
    return image.to(torch.uint8)


def make_examples(n: int, size: int, seed: int) -> list[dict[str, Any]]:
    """`n` examples {"image", "question", "answer"}: a random colour, shape and quadrant, one question about it."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        colour, shape, position = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(POSITIONS)
        kind = rng.choice(list(QUESTIONS))
        answer = {"colour": colour, "where": position}[kind]
        rows.append({"image": draw(colour, shape, position, size, rng), "question": QUESTIONS[kind], "answer": answer})
    return rows


def patchify(image: torch.Tensor, layout: PatchLayout) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(patch rows (t*h*w, 3*temporal*patch*patch) float32, grid (t, h, w)) of one (3, H, W) uint8 image, laid out
    as Qwen2VLImageProcessor lays it out (merge-size blocks of patches next to each other). H and W must be
    multiples of patch_size * merge_size."""
    channels, height, width = image.shape
    p, m, tp = layout.patch_size, layout.merge_size, layout.temporal_patch_size
    if height % (p * m) or width % (p * m):
        raise ValueError(f"image size {height}x{width} must be a multiple of patch_size * merge_size = {p * m}")
    mean = torch.tensor(IMAGE_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGE_STD).view(3, 1, 1)
    pixels = (image.float() / 255.0 - mean) / std
    frames = pixels.unsqueeze(0).expand(tp, -1, -1, -1)  # a still image fills the temporal patch
    gh, gw = height // p, width // p
    x = frames.reshape(1, tp, channels, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gh * gw, channels * tp * p * p).contiguous(), (1, gh, gw)


def with_answer(prompt: list[int], answer: str, tokenizer: Any) -> dict[str, list[int]]:
    """`input_ids`: `prompt`, then the answer's tokens and EOS; `labels`: -100 on the prompt, then the answer's
    tokens and EOS (the loss on the answer only)."""
    target = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return {"input_ids": prompt + target, "labels": [IGNORE_INDEX] * len(prompt) + target}


def encode_vl(row: dict[str, Any], tokenizer: Any, layout: PatchLayout,
              with_mm_token_types: bool = True) -> dict[str, Any]:
    """One training example: `<bos> <|vision_start|> <|image_pad|> x N <|vision_end|> question` then the answer and
    EOS, the loss on the answer only; `pixel_values` / `image_grid_thw` of the image and, for transformers whose
    Qwen-VL forward takes it, `mm_token_type_ids` (1 on image tokens)."""
    pixels, grid = patchify(row["image"], layout)
    ids = tokenizer.convert_tokens_to_ids
    prompt = ([tokenizer.bos_token_id, ids(VISION_START)] + [ids(IMAGE_PAD)] * layout.tokens(grid)
              + [ids(VISION_END)] + tokenizer(row["question"], add_special_tokens=False)["input_ids"])
    out = {**with_answer(prompt, row["answer"], tokenizer), "pixel_values": pixels,
           "image_grid_thw": torch.tensor([grid])}
    if with_mm_token_types:
        out["mm_token_type_ids"] = [int(t == ids(IMAGE_PAD)) for t in out["input_ids"]]
    return out


def takes_mm_token_types(model_or_class: Any) -> bool:
    """Whether a Qwen-VL model's forward takes `mm_token_type_ids` (transformers 5: needed for 3-D positions;
    4.57 finds image tokens by id and has no such argument)."""
    import inspect

    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    return "mm_token_type_ids" in inspect.signature(cls.forward).parameters


class VLCollator:
    """Right-pads a batch of `encode_vl` rows: input_ids (pad id), labels (-100), attention_mask,
    mm_token_type_ids (0 on padding, kept whenever the rows carry it); pixel_values of every image concatenated in
    row order and image_grid_thw stacked, as a Qwen-VL forward takes them. Packed rows are refused: their 3-D
    positions would need one get_rope_index per packed example."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if "position_ids" in batch[0]:
            raise ValueError("VLCollator: packed rows (position_ids) are not supported for image data; "
                             "set data.packing: false")
        length = max(len(x["input_ids"]) for x in batch)
        rows = len(batch)
        out = {"input_ids": torch.full((rows, length), self.pad_token_id, dtype=torch.long),
               "labels": torch.full((rows, length), IGNORE_INDEX, dtype=torch.long),
               "attention_mask": torch.zeros((rows, length), dtype=torch.long)}
        typed = "mm_token_type_ids" in batch[0]
        if typed:
            out["mm_token_type_ids"] = torch.zeros((rows, length), dtype=torch.long)
        for i, x in enumerate(batch):
            n = len(x["input_ids"])
            out["input_ids"][i, :n] = torch.as_tensor(x["input_ids"])
            out["labels"][i, :n] = torch.as_tensor(x["labels"])
            out["attention_mask"][i, :n] = 1
            if typed:
                out["mm_token_type_ids"][i, :n] = torch.as_tensor(x["mm_token_type_ids"])
        # tensors as encode_vl made them, or as a `datasets.Dataset` in torch format gives them back
        out["pixel_values"] = torch.cat([torch.as_tensor(x["pixel_values"], dtype=torch.float32) for x in batch])
        out["image_grid_thw"] = torch.cat([torch.as_tensor(x["image_grid_thw"], dtype=torch.long) for x in batch])
        return out
