"""Synthetic audio + image + text data for `mindspeed-hf train --recipe omni` and the Omni thinker example.

Each example is one short audio clip, one image and one question about either. The clip is a log-mel spectrogram
generated directly (no audio library, no waveform): quiet broadband noise with one tone in it, whose pitch (the
mel band it sits in: low, mid or high) and duration (short or long) vary; the clips themselves have different
lengths, so a batch is padded. The image is the VL recipe's (recipes/vl_data.py: one coloured shape in one quadrant).
Questions: "what is the pitch" -> "high", "what is the length" -> "short", "what is the colour" -> "red".

Rows are built without a processor, the way Qwen2.5-Omni's processor lays them out:
`<bos> <|audio_bos|> <|AUDIO|> x A <|audio_eos|> <|vision_bos|> <|IMAGE|> x I <|vision_eos|> question`, then the
answer and EOS, with A from the model's own length rule (`audio_token_rule`) and I from the image grid. `OmniCollator`
pads a batch and adds `input_features` [clips, mel bins, frames] (zero-padded) and `feature_attention_mask`
[clips, frames] to the VL collator's fields; labels are -100 on everything but the answer and its EOS.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from ..data import pad_audio_clips
from .vl_data import (
    COLOURS,
    POSITIONS,
    SHAPES,
    PatchLayout,
    VLCollator,
    draw,
    make_tokenizer,
    patchify,
    with_answer,
)

# Qwen2.5-Omni's special tokens, spelled as its tokenizer spells them.
AUDIO_START, AUDIO_PAD, AUDIO_END = "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"
VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_bos|>", "<|IMAGE|>", "<|vision_eos|>", "<|VIDEO|>"
OMNI_SPECIALS = ("<pad>", "<unk>", "<bos>", "<eos>", AUDIO_START, AUDIO_PAD, AUDIO_END, VISION_START, IMAGE_PAD,
                 VISION_END, VIDEO_PAD)
# Each question ends on the word naming what is asked: the token the answer is predicted from names it, so a model
# this small needs no hop back to the question word across the clip's and the image's tokens.
AUDIO_QUESTIONS = {"pitch": "what is the pitch", "length": "what is the length"}
# The image question: its colour. The quadrant (the VL recipe's other question) and the shape are distractors here.
IMAGE_QUESTIONS = {"colour": "what is the colour"}
OMNI_QUESTIONS = {**AUDIO_QUESTIONS, **IMAGE_QUESTIONS}
MEL_BINS = 16
PITCHES = {"low": 3, "mid": 8, "high": 13}  # the mel band the tone sits in (+-1 band of jitter)
DURATIONS = {"short": (2, 5), "long": (14, 20)}  # tone frames, inclusive range
CLIP_FRAMES = (24, 36)  # clip length in mel frames, inclusive range


def omni_texts() -> tuple[str, ...]:
    """Every question and answer of the data (the tokenizer's words)."""
    return (*OMNI_QUESTIONS.values(), *PITCHES, *DURATIONS, *COLOURS)


def make_omni_tokenizer() -> Any:
    """The word-level tokenizer of vl_data.make_tokenizer over the Omni special tokens and `omni_texts()`."""
    return make_tokenizer(OMNI_SPECIALS, omni_texts())


def tone_clip(pitch: str, duration: str, rng: random.Random, mel_bins: int = MEL_BINS) -> torch.Tensor:
    """A (mel_bins, frames) float32 log-mel spectrogram: a clip of CLIP_FRAMES frames of faint noise with one tone
    of `pitch` lasting `duration` at a random onset, log10 power normalised as Whisper-style feature extractors do
    (clamped to 8 decades below the peak, then (x + 4) / 4)."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    frames = rng.randint(*CLIP_FRAMES)
    length = rng.randint(*DURATIONS[duration])
    onset = rng.randint(0, frames - length)
    centre = PITCHES[pitch] * mel_bins / MEL_BINS + rng.uniform(-1.0, 1.0)
    power = torch.empty(mel_bins, frames).exponential_(generator=gen) * 1e-4
    band = torch.exp(-0.5 * (torch.arange(mel_bins, dtype=torch.float32) - centre) ** 2)
    gain = 10 ** rng.uniform(-0.5, 0.5)
    power[:, onset:onset + length] += gain * band.unsqueeze(1)
    log = power.clamp(min=1e-10).log10()
    log = torch.maximum(log, log.max() - 8.0)
    return (log + 4.0) / 4.0


def make_omni_examples(n: int, image_size: int, seed: int) -> list[dict[str, Any]]:
    """`n` examples {"audio", "image", "question", "answer", "kind"}: a random tone (pitch, duration) and a random
    image (colour, shape, quadrant), one question (`kind`: pitch, length or colour)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        pitch, duration = rng.choice(list(PITCHES)), rng.choice(list(DURATIONS))
        colour, shape, position = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(POSITIONS)
        kind = rng.choice(list(OMNI_QUESTIONS))
        answer = {"pitch": pitch, "length": duration, "colour": colour}[kind]
        rows.append({"audio": tone_clip(pitch, duration, rng), "image": draw(colour, shape, position, image_size, rng),
                     "question": OMNI_QUESTIONS[kind], "answer": answer, "kind": kind})
    return rows


def audio_token_rule(model: Any) -> Callable[[int], int]:
    """frames -> placeholder tokens of one clip, by the thinker's audio tower's own rule
    (`_get_feat_extract_output_lengths`: its stride-2 convolution, then its stride-2 pooling)."""
    tower = getattr(model, "audio_tower", None) or model.model.audio_tower  # transformers 5.24: under model.model

    def rule(frames: int) -> int:
        return int(tower._get_feat_extract_output_lengths(torch.tensor([frames]))[1])

    return rule


def encode_omni(row: dict[str, Any], tokenizer: Any, layout: PatchLayout,
                audio_rule: Callable[[int], int]) -> dict[str, Any]:
    """One training example: the audio span (`audio_rule(frames)` placeholders: `audio_token_rule(model)`), the
    image span and the question as the prompt, then the answer and EOS (the loss on the answer only);
    `input_features` (mel bins, frames) of the clip, `pixel_values` / `image_grid_thw` of the image."""
    pixels, grid = patchify(row["image"], layout)
    ids = tokenizer.convert_tokens_to_ids
    prompt = ([tokenizer.bos_token_id, ids(AUDIO_START)] + [ids(AUDIO_PAD)] * audio_rule(row["audio"].shape[1])
              + [ids(AUDIO_END), ids(VISION_START)] + [ids(IMAGE_PAD)] * layout.tokens(grid) + [ids(VISION_END)]
              + tokenizer(row["question"], add_special_tokens=False)["input_ids"])
    return {**with_answer(prompt, row["answer"], tokenizer), "input_features": row["audio"],
            "pixel_values": pixels, "image_grid_thw": torch.tensor([grid])}


class OmniCollator(VLCollator):
    """VLCollator's batch (right-padded ids, labels -100 on padding, attention_mask, pixel_values, image_grid_thw)
    plus the audio: `input_features` (clips, mel bins, longest clip's frames), zero-padded, and
    `feature_attention_mask` (clips, frames), 1 on each clip's own frames; one clip per row, in row order."""

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        out = super().__call__(batch)
        clips = [torch.as_tensor(x["input_features"], dtype=torch.float32) for x in batch]
        out.update(pad_audio_clips([{"input_features": clip, "feature_attention_mask": torch.ones(
            clip.shape[-1], dtype=torch.long)} for clip in clips]))
        return out
