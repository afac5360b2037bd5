"""A tiny Qwen2.5-Omni thinker from a config (no downloads) and the batches its tests feed it: two audio clips of
different lengths (mel features padded to one length, with their feature mask) and two images of different grids,
one of each per row, text around them, padded right or left."""

from __future__ import annotations

import torch
from tiny_vlms import _TEXT, _VISION, END, IMAGE, START, VLM_VOCAB, _mrope

AUDIO, AUDIO_START, AUDIO_END, VIDEO = 240, 241, 242, 251
MEL = 16
FRAMES = (40, 26)  # mel frames per clip: the encoder cuts them into windows of 2 * n_window frames
GRIDS = ((1, 8, 8), (1, 4, 4))  # one image per row


def tiny_omni_thinker(seed: int = 0, **overrides):
    """Qwen2_5OmniThinkerForConditionalGeneration, fp32: 2 text layers (M-RoPE), a 2-block Qwen2.5-VL-style
    vision tower, a 2-layer audio encoder with 16-frame windows."""
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    vision = {**_VISION, "window_size": 16, "fullatt_block_indexes": [1], "hidden_act": "silu"}
    audio = dict(num_mel_bins=MEL, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=_TEXT["hidden_size"], n_window=8, max_source_positions=200)
    config = Qwen2_5OmniThinkerConfig(
        text_config={**_TEXT, **_mrope()}, vision_config=vision, audio_config=audio, audio_token_index=AUDIO,
        image_token_index=IMAGE, video_token_index=VIDEO, audio_start_token_id=AUDIO_START,
        audio_end_token_id=AUDIO_END, vision_start_token_id=START, vision_end_token_id=END, **overrides)
    torch.manual_seed(seed)
    return Qwen2_5OmniThinkerForConditionalGeneration(config).float()


def omni_batch(model, left: bool = False, seed: int = 1) -> dict[str, torch.Tensor]:
    """Two rows, each with one audio clip and one image; labels -100 on audio, image and padding tokens."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(len(FRAMES), MEL, max(FRAMES), generator=gen)
    feature_mask = torch.zeros(len(FRAMES), max(FRAMES), dtype=torch.long)
    for clip, frames in enumerate(FRAMES):
        feature_mask[clip, :frames] = 1
    tower = getattr(model, "audio_tower", None) or model.model.audio_tower  # 5.24 moved the towers to model.model
    _, audio_tokens = tower._get_feat_extract_output_lengths(feature_mask.sum(-1))
    rows = []
    for row, (clip_tokens, grid) in enumerate(zip(audio_tokens.tolist(), GRIDS)):
        ids = torch.randint(3, 230, (4 + 2 * row,), generator=gen).tolist()
        ids += [AUDIO_START] + [AUDIO] * clip_tokens + [AUDIO_END]
        ids += [START] + [IMAGE] * (grid[0] * grid[1] * grid[2] // 4) + [END]
        rows.append(ids + torch.randint(3, 230, (6,), generator=gen).tolist())
    length = max(map(len, rows)) + 2
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(rows):
        span = slice(length - len(ids), length) if left else slice(0, len(ids))
        input_ids[row, span], mask[row, span] = torch.tensor(ids), 1
    grid = torch.tensor(GRIDS)
    return {"input_ids": input_ids, "attention_mask": mask,
            "labels": input_ids.masked_fill((mask == 0) | (input_ids >= AUDIO) | (input_ids >= VLM_VOCAB), -100),
            "input_features": features, "feature_attention_mask": feature_mask,
            "pixel_values": torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4, generator=gen),
            "image_grid_thw": grid}
