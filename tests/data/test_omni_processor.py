"""HF's processor path for the Omni thinker: rows made one example at a time by transformers'
`Qwen2_5OmniProcessor` (its Whisper feature extractor on waveforms, its Qwen2-VL image processor on PIL images, a
tokenizer carrying the Omni special tokens) are packed by `mindspeed_hf.data.FlatteningCollator` and train, with
mindspeed_hf on, equal to the processor's own padded batch of the same examples on plain HF (the loss, every
gradient: audio tower, vision tower, text model). HF's processor builds a video processor that needs torchvision:
without it this file is skipped (.ci/run gives it an environment with torchvision)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from tiny_omni import AUDIO, AUDIO_END, AUDIO_START, MEL, tiny_omni_thinker
from tiny_vlms import END, IMAGE, START, VIDEO

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.data import FlatteningCollator

pytest.importorskip("torchvision")
SPECIAL = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, "<|AUDIO|>": AUDIO, "<|audio_bos|>": AUDIO_START,
           "<|audio_eos|>": AUDIO_END, "<|IMAGE|>": IMAGE, "<|VIDEO|>": VIDEO, "<|vision_bos|>": START,
           "<|vision_eos|>": END}
WORDS = ("what", "is", "the", "pitch", "colour", "high", "low", "red", "blue")
# (seconds of audio, image side in pixels, question, answer): clips and image grids of different sizes
EXAMPLES = ((0.9, 16, "what is the pitch", "high"), (0.5, 32, "what is the colour", "red"),
            (1.3, 24, "what is the colour", "blue"))


def _processor():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5OmniProcessor,
        Qwen2VLImageProcessor,
        WhisperFeatureExtractor,
    )
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    vocab = {**SPECIAL, **{word: 10 + i for i, word in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    names = {"audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
             "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "vision_bos_token": "<|vision_bos|>",
             "vision_eos_token": "<|vision_eos|>"}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        bos_token="<bos>", eos_token="<eos>", extra_special_tokens=names)
    # the tiny thinker's vision tower: 4-pixel patches, 2 frames per temporal patch, 2x2 merge
    images = Qwen2VLImageProcessor(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16,
                                   max_pixels=32 * 32)
    return Qwen2_5OmniProcessor(image_processor=images, video_processor=Qwen2VLVideoProcessor(),
                                feature_extractor=WhisperFeatureExtractor(feature_size=MEL), tokenizer=tokenizer)


def _media(seed: int = 0) -> tuple[list[np.ndarray], list, list[str], list[str]]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    waves, images, prompts, answers = [], [], [], []
    for seconds, side, question, answer in EXAMPLES:
        t = np.arange(int(16000 * seconds)) / 16000
        waves.append((np.sin(2 * np.pi * 440 * t) + 0.1 * rng.standard_normal(len(t))).astype(np.float32))
        images.append(Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)))
        prompts.append(f"<bos> <|audio_bos|> <|AUDIO|> <|audio_eos|> <|vision_bos|> <|IMAGE|> <|vision_eos|> "
                       f"{question}")
        answers.append(f"{answer} <eos>")
    return waves, images, prompts, answers


def _labels(input_ids: torch.Tensor, attention_mask: torch.Tensor, answer_tokens: list[int]) -> torch.Tensor:
    """-100 but on each row's last `answer_tokens[row]` real tokens (the answer and EOS; the processor pads left)."""
    labels = torch.full_like(input_ids, -100)
    for row, n in enumerate(answer_tokens):
        last = int(attention_mask[row].nonzero().max()) + 1
        labels[row, last - n:last] = input_ids[row, last - n:last]
    return labels


def _loss_and_grads(model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_processor_rows_packed_equal_its_padded_batch(backend):
    processor = _processor()
    waves, images, prompts, answers = _media()
    texts = [f"{p} {a}" for p, a in zip(prompts, answers)]
    answer_tokens = [len(a.split()) for a in answers]
    padded = dict(processor(text=texts, audio=waves, images=images, padding=True, return_tensors="pt"))
    assert padded["input_features"].shape[0] == len(EXAMPLES) and padded["image_grid_thw"].shape[0] == len(EXAMPLES)
    padded["labels"] = _labels(padded["input_ids"], padded["attention_mask"], answer_tokens)
    rows = []
    for text, wave, image, n in zip(texts, waves, images, answer_tokens):
        row = dict(processor(text=[text], audio=[wave], images=[image], return_tensors="pt"))
        row["labels"] = _labels(row["input_ids"], row["attention_mask"], [n])
        rows.append(row)
    packed = FlatteningCollator()(rows)
    assert packed["input_ids"].shape == (1, int(padded["attention_mask"].sum()))

    plain = tiny_omni_thinker()
    ours = copy.deepcopy(plain)
    want_loss, want = _loss_and_grads(plain, padded)
    mindspeed_hf.enable(config_from_dict({"backend": backend}))
    mindspeed_hf.apply_to_model(ours)
    loss, got = _loss_and_grads(ours, packed)
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    assert got.keys() == want.keys()
    for tower in ("audio_tower", "visual", "layers.1."):
        assert any(tower in name for name in got), tower
    worst = max(float((got[n] - want[n]).norm() / want[n].norm().clamp(min=1e-12)) for n in want)
    assert worst < 1e-4, worst
    ran = mindspeed_hf.report(ours)["ran"]
    assert ran["fused_linear_cross_entropy"] == 1 and ran["vision_attention"] > 0
    # HF alone on the packed row (no per-document positions from our patch) is another computation: a control
    mindspeed_hf.disable()
    assert abs(float(plain(**packed).loss) - float(want_loss)) > 1e-4
