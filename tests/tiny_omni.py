"""A tiny Qwen2.5-Omni thinker from a config (no downloads) and the batches its tests feed it: two audio clips of
different lengths (mel features padded to one length, with their feature mask) and two images of different grids,
one of each per row, text around them, padded right or left."""

from __future__ import annotations

import torch
from tiny_vlms import _TEXT, _VISION, END, IMAGE, START, VLM_VOCAB, _mrope

AUDIO, AUDIO_START, AUDIO_END, VIDEO = 240, 241, 242, 251
MEL = 16
FRAMES = (130, 70)  # mel frames per clip: the encoders cut them into windows (16 frames; Qwen3-Omni: 100)
GRIDS = ((1, 8, 8), (1, 4, 4))  # one image per row


OMNI_TYPES = ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker")


def tiny_omni_thinker(model_type: str = "qwen2_5_omni_thinker", seed: int = 0, **overrides):
    """A thinker, fp32: 2 text layers (M-RoPE; Qwen3-Omni: MoE, interleaved sections), a 2-block vision tower
    (Qwen2.5-VL-style; Qwen3-Omni: Qwen3-VL-style with deepstack), a 2-layer audio encoder (Qwen2.5-Omni: 16-frame
    windows; Qwen3-Omni: its 100-frame chunks)."""
    import transformers

    audio = dict(num_mel_bins=MEL, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=_TEXT["hidden_size"], max_source_positions=200)
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
               audio_start_token_id=AUDIO_START)
    if model_type == "qwen3_omni_moe_thinker":
        text = {**_TEXT, "head_dim": 16, **_mrope(interleaved=True), "num_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32, "decoder_sparse_step": 1}
        vision = {**_VISION, "num_position_embeddings": 64, "deepstack_visual_indexes": [0],
                  "hidden_act": "gelu_pytorch_tanh"}
        audio.update(downsample_hidden_size=16)
        config = transformers.Qwen3OmniMoeThinkerConfig(text_config=text, vision_config=vision, audio_config=audio,
                                                        audio_token_id=AUDIO, **ids, **overrides)
        head = transformers.Qwen3OmniMoeThinkerForConditionalGeneration
    else:
        vision = {**_VISION, "window_size": 16, "fullatt_block_indexes": [1], "hidden_act": "silu"}
        audio.update(n_window=8)
        config = transformers.Qwen2_5OmniThinkerConfig(
            text_config={**_TEXT, **_mrope()}, vision_config=vision, audio_config=audio, audio_token_index=AUDIO,
            image_token_index=IMAGE, video_token_index=VIDEO, audio_start_token_id=AUDIO_START,
            audio_end_token_id=AUDIO_END, vision_start_token_id=START, vision_end_token_id=END, **overrides)
        head = transformers.Qwen2_5OmniThinkerForConditionalGeneration
    torch.manual_seed(seed)
    return head(config).float()


def _audio_tokens(model, lengths: torch.Tensor) -> list[int]:
    """Each clip's placeholder tokens, by the model's own length rule."""
    if model.config.model_type == "qwen3_omni_moe_thinker":
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as modeling

        rule = modeling._get_feat_extract_output_lengths  # takes n_window from transformers 5.20 on (100 before)
        takes_window = len(__import__("inspect").signature(rule).parameters) > 1
        return (rule(lengths, model.config.audio_config.n_window) if takes_window else rule(lengths)).tolist()
    tower = getattr(model, "audio_tower", None) or model.model.audio_tower  # 5.24 moved the towers to model.model
    return tower._get_feat_extract_output_lengths(lengths)[1].tolist()


def omni_batch(model, left: bool = False, seed: int = 1, text: int = 6) -> dict[str, torch.Tensor]:
    """Two rows, each with one audio clip and one image, then `text` text tokens; labels -100 on audio, image and
    padding tokens."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(len(FRAMES), MEL, max(FRAMES), generator=gen)
    feature_mask = torch.zeros(len(FRAMES), max(FRAMES), dtype=torch.long)
    for clip, frames in enumerate(FRAMES):
        feature_mask[clip, :frames] = 1
    rows = []
    for row, (clip_tokens, grid) in enumerate(zip(_audio_tokens(model, feature_mask.sum(-1)), GRIDS)):
        ids = torch.randint(3, 230, (4 + 2 * row,), generator=gen).tolist()
        ids += [AUDIO_START] + [AUDIO] * clip_tokens + [AUDIO_END]
        ids += [START] + [IMAGE] * (grid[0] * grid[1] * grid[2] // 4) + [END]
        rows.append(ids + torch.randint(3, 230, (text,), generator=gen).tolist())
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


ROW_CLIPS = ((130,), (70, 40), (), (90,))  # mel frames of each row's audio clips (cycled)
ROW_GRIDS = (((1, 4, 4),), (), ((1, 8, 8), (1, 4, 8)), ())  # each row's images (cycled)


ROW_VIDEOS = (((2, 4, 4),), (), ((2, 4, 8),), ())  # each row's videos (cycled), with `videos`
VIDEO_SECONDS = (0.5, 1.0, 0.3)  # seconds per temporal grid (cycled): fractional temporal positions on Qwen3-Omni
VIDEO_CLIP = 60  # mel frames of a video's own audio track (audio_in_video)


def omni_rows(model, count: int = 16, seed: int = 7, videos: bool = False, audio_in_video: bool = False) -> list[dict]:
    """`count` unpadded rows, a processor's output per example: input_ids, labels (-100 on audio, image and video
    tokens), and each row's own `input_features` [clips, mel, frames] / `feature_attention_mask` (its clips padded
    to its longest), `pixel_values` / `image_grid_thw`. Rows with audio and images, audio only, images only,
    neither. With `videos`, some rows end with a video (`pixel_values_videos`, `video_grid_thw`,
    `video_second_per_grid`); with `audio_in_video` too, every video carries its own audio track (its clip comes after
    the row's other clips; placeholders: vision start, audio start, the video's tokens, then its audio tokens, audio
    end, vision end: the layout of the processor's one-chunk case; the model must be called with
    use_audio_in_video=True)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for index in range(count):
        clips, grids = ROW_CLIPS[index % len(ROW_CLIPS)], ROW_GRIDS[(index // 2) % len(ROW_GRIDS)]
        movies = ROW_VIDEOS[index % len(ROW_VIDEOS)] if videos or audio_in_video else ()
        ids = torch.randint(3, 230, (3 + index % 4,), generator=gen).tolist()
        frames = torch.tensor(clips, dtype=torch.long)
        for tokens in (_audio_tokens(model, frames) if clips else []):
            ids += [AUDIO_START] + [AUDIO] * tokens + [AUDIO_END] + torch.randint(3, 230, (2,), generator=gen).tolist()
        for grid in grids:
            ids += [START] + [IMAGE] * (grid[0] * grid[1] * grid[2] // 4) + [END]
            ids += torch.randint(3, 230, (2 + index % 3,), generator=gen).tolist()
        for t, h, w in movies:
            video = [VIDEO] * (t * h * w // 4)
            if audio_in_video:
                track = [AUDIO] * _audio_tokens(model, torch.tensor([VIDEO_CLIP]))[0]
                ids += [START, AUDIO_START, *video, *track, AUDIO_END, END]
            else:
                ids += [START, *video, END]
            ids += torch.randint(3, 230, (3,), generator=gen).tolist()
        if audio_in_video:
            clips = (*clips, *(VIDEO_CLIP,) * len(movies))
            frames = torch.tensor(clips, dtype=torch.long)
        input_ids = torch.tensor(ids)
        row = {"input_ids": ids, "labels": input_ids.masked_fill(input_ids >= AUDIO, -100).tolist()}
        if clips:
            mask = (torch.arange(max(clips))[None] < frames[:, None]).long()
            row["input_features"] = torch.randn(len(clips), MEL, max(clips), generator=gen) * mask[:, None]
            row["feature_attention_mask"] = mask
        if grids:
            grid = torch.tensor(grids)
            row["image_grid_thw"] = grid
            row["pixel_values"] = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4, generator=gen)
        if movies:
            grid = torch.tensor(movies)
            row["video_grid_thw"] = grid
            row["pixel_values_videos"] = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4, generator=gen)
            row["video_second_per_grid"] = torch.tensor([VIDEO_SECONDS[index % len(VIDEO_SECONDS)]] * len(movies))
        rows.append(row)
    return rows
