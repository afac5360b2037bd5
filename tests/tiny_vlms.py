"""Tiny vision-language models from configs (no downloads), and the multimodal batches the VLM tests feed them:
several images of different grids per batch, random pixels, padded text."""

from __future__ import annotations

import inspect

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, modeling_rope_utils

VLM_VOCAB = 256
IMAGE, VIDEO, START, END = 250, 251, 252, 253
_TEXT = dict(vocab_size=VLM_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False)
_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
               spatial_merge_size=2, out_hidden_size=64, in_channels=3)
_IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
# (t, h, w) patch grids of the images in a batch: sample 0 holds the first two, sample 1 the third.
GRIDS = ((1, 8, 8), (1, 4, 4), (1, 4, 8))
SAMPLE_IMAGES = ((0, 1), (2,))


def _mrope(interleaved: bool = False) -> dict:
    section = [2, 3, 3]  # sums to head_dim / 2 = 8
    if hasattr(modeling_rope_utils, "RopeParameters"):
        params = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": section}
        if interleaved:
            params["mrope_interleaved"] = True
        return {"rope_parameters": params}
    scaling = {"type": "default", "rope_type": "default", "mrope_section": section}
    if interleaved:
        scaling["mrope_interleaved"] = True
    return {"rope_theta": 1e4, "rope_scaling": scaling}


def _qwen_vl(model_type: str) -> dict:
    if model_type == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=4,
                      temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
        return dict(text_config={**_TEXT, **_mrope()}, vision_config=vision, **_IDS)
    if model_type == "qwen2_5_vl":
        vision = {**_VISION, "window_size": 16, "fullatt_block_indexes": [1], "hidden_act": "silu"}
        return dict(text_config={**_TEXT, **_mrope()}, vision_config=vision, **_IDS)
    text = {**_TEXT, "head_dim": 16, **_mrope(interleaved=True)}
    if model_type in HYBRID_VL:  # Gated DeltaNet + gated full attention; partial rope (head_dim 16, 4 rotated)
        text.update(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
        text["rope_parameters"] = {**text["rope_parameters"], "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 2]}
        vision = {**_VISION, "num_position_embeddings": 64, "hidden_act": "gelu_pytorch_tanh"}
        if model_type == "qwen3_5_moe":
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48)
        return dict(text_config=text, vision_config=vision, **_IDS)
    if model_type == "qwen3_vl_moe":
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    vision = {**_VISION, "num_position_embeddings": 64, "deepstack_visual_indexes": [0],
              "hidden_act": "gelu_pytorch_tanh"}
    return dict(text_config=text, vision_config=vision, **_IDS)


def _llava() -> dict:
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32)
    text = {**_TEXT, "model_type": "qwen3", "head_dim": 16}
    return dict(vision_config=vision, text_config=text, image_token_id=IMAGE, vision_feature_layer=-1,
                vision_feature_select_strategy="full")


def _internvl() -> dict:
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=[32, 32], patch_size=[8, 8], use_qk_norm=False, norm_type="layer_norm")
    text = {**_TEXT, "model_type": "qwen2"}
    return dict(vision_config=vision, text_config=text, image_token_id=IMAGE, downsample_ratio=0.5,
                vision_feature_layer=-1, vision_feature_select_strategy="default")


HYBRID_VL = ("qwen3_5", "qwen3_5_moe")  # transformers >= 5.x only; their packed reference: tests/models/test_hybrid.py
QWEN_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", *HYBRID_VL)
VLM_TYPES = (*QWEN_VL, "llava", "internvl")
# Image tokens per image for the fixed-size towers (llava: 16 patches + CLS; internvl: 16 patches shuffled by 0.5^2).
_FIXED_TOKENS = {"llava": 17, "internvl": 4}


def tiny_vlm_config(model_type: str, **overrides):
    kwargs = {"llava": _llava, "internvl": _internvl}.get(model_type, lambda: _qwen_vl(model_type))()
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_vlm(model_type: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(tiny_vlm_config(model_type, **overrides)).float()


def _image_tokens(model_type: str, image: int) -> list[int]:
    if model_type in _FIXED_TOKENS:
        return [IMAGE] * _FIXED_TOKENS[model_type]
    t, h, w = GRIDS[image]
    return [START] + [IMAGE] * (t * h * w // 4) + [END]


def _accepts(model, name: str) -> bool:
    return name in inspect.signature(type(model).forward).parameters


def vlm_batch(model, left: bool = False, seed: int = 3) -> dict[str, torch.Tensor]:
    """Two samples with images of different grids, text around them, padded to one length (right or left);
    labels -100 on image, vision start/end and padding tokens."""
    model_type = model.config.model_type
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for sample, images in enumerate(SAMPLE_IMAGES):
        ids = torch.randint(3, 240, (5 + 3 * sample,), generator=gen).tolist()
        for image in images:
            ids += _image_tokens(model_type, image) + torch.randint(3, 240, (4,), generator=gen).tolist()
        rows.append(ids)
    length = max(map(len, rows)) + 3
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, ids in enumerate(rows):
        span = slice(length - len(ids), length) if left else slice(0, len(ids))
        input_ids[i, span] = torch.tensor(ids)
        mask[i, span] = 1
    image_ids = (input_ids == IMAGE) | (input_ids == START) | (input_ids == END)
    labels = input_ids.masked_fill(image_ids | (mask == 0), -100)
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
    if model_type in _FIXED_TOKENS:
        batch["pixel_values"] = torch.randn(len(GRIDS), 3, 32, 32, generator=gen)
    else:
        grid = torch.tensor(GRIDS)
        patch = 3 * 2 * 4 * 4
        batch["pixel_values"] = torch.randn(int(grid.prod(-1).sum()), patch, generator=gen)
        batch["image_grid_thw"] = grid
    if _accepts(model, "mm_token_type_ids"):
        batch["mm_token_type_ids"] = (input_ids == IMAGE).long()
    return batch


def packed_vlm_batch(model, seed: int = 3) -> dict[str, torch.Tensor]:
    """vlm_batch's two samples packed in one row (no padding, no attention mask), told apart by 1-D position ids
    restarting at 0; the first token of the second sample is not predicted from the first."""
    batch = vlm_batch(model, seed=seed)
    lengths = batch["attention_mask"].sum(1).tolist()
    keep = batch["attention_mask"].bool()
    packed = {k: batch[k][keep].unsqueeze(0) for k in ("input_ids", "labels")}
    packed["labels"][0, lengths[0]] = -100
    text_positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    packed["position_ids"] = text_positions
    if "image_grid_thw" in batch:  # M-RoPE: the samples' own 3-D positions, after the text row that marks packing
        rope_index = model.model.get_rope_index
        extra = {k: batch[k] for k in ("mm_token_type_ids",) if k in inspect.signature(rope_index).parameters}
        rope, _ = rope_index(input_ids=batch["input_ids"], image_grid_thw=batch["image_grid_thw"],
                             attention_mask=batch["attention_mask"], **extra)
        rope = torch.cat([rope[:, row, keep[row]] for row in range(len(lengths))], dim=1).unsqueeze(1)
        packed["position_ids"] = torch.cat([text_positions.unsqueeze(0), rope])
        packed.update({k: v[keep].unsqueeze(0) for k, v in extra.items()})
    return {**packed, "use_cache": False}


# ------------------------------------------------------------------------------------- rows for packing tests

# Images per row, cycled over the rows: grids of different shapes, rows with none and with two.
ROW_IMAGES = (((1, 4, 4),), ((1, 8, 8), (1, 4, 8)), (), ((1, 8, 4),))
# Rows with videos (cycled with the image rows when videos are asked for): (t, h, w) of each video.
ROW_VIDEOS = (((2, 4, 4),), (), ((2, 4, 8),), ())
_PATCH = 3 * 2 * 4 * 4  # in_channels * temporal_patch_size * patch_size^2


def _video_tokens(model_type: str, grid: tuple[int, int, int], gen: torch.Generator) -> list[int]:
    """A video's placeholder tokens: one run (Qwen2-VL, Qwen2.5-VL), or one run per temporal patch after a
    timestamp text token (Qwen3-VL's and Qwen3.5's processors)."""
    t, h, w = grid
    if model_type.startswith(("qwen3_vl", "qwen3_5")):
        frame = [START] + [VIDEO] * (h * w // 4) + [END]
        return [token for _ in range(t) for token in [int(torch.randint(3, 240, (1,), generator=gen)), *frame]]
    return [START] + [VIDEO] * (t * h * w // 4) + [END]


def vlm_rows(model, count: int = 16, videos: bool = False, seed: int = 5) -> list[dict]:
    """`count` unpadded rows (a processor's output per example): input_ids, labels (-100 on vision tokens),
    mm_token_type_ids (when the model takes them) and each row's own vision tensors. Images of different grids,
    rows without any; with `videos`, videos too (and Qwen2.5-VL's second_per_grid_ts)."""
    model_type = model.config.model_type
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for index in range(count):
        images = ROW_IMAGES[index % len(ROW_IMAGES)]
        clips = ROW_VIDEOS[index % len(ROW_VIDEOS)] if videos else ()
        ids = torch.randint(3, 240, (3 + index % 5,), generator=gen).tolist()
        for grid in images:
            ids += [START] + [IMAGE] * (grid[0] * grid[1] * grid[2] // 4) + [END]
            ids += torch.randint(3, 240, (2 + index % 3,), generator=gen).tolist()
        for grid in clips:
            ids += _video_tokens(model_type, grid, gen) + torch.randint(3, 240, (3,), generator=gen).tolist()
        input_ids = torch.tensor(ids)
        vision = (input_ids == IMAGE) | (input_ids == VIDEO) | (input_ids == START) | (input_ids == END)
        row = {"input_ids": ids, "labels": input_ids.masked_fill(vision, -100).tolist()}
        if _accepts(model, "mm_token_type_ids"):
            row["mm_token_type_ids"] = ((input_ids == IMAGE).long() + 2 * (input_ids == VIDEO).long()).tolist()
        if images:
            grid = torch.tensor(images)
            row["image_grid_thw"] = grid
            row["pixel_values"] = torch.randn(int(grid.prod(-1).sum()), _PATCH, generator=gen)
        if clips:
            grid = torch.tensor(clips)
            row["video_grid_thw"] = grid
            row["pixel_values_videos"] = torch.randn(int(grid.prod(-1).sum()), _PATCH, generator=gen)
            if _accepts(model, "second_per_grid_ts"):
                row["second_per_grid_ts"] = torch.tensor([0.5 + index % 3] * len(clips))
        rows.append(row)
    return rows


def pad_rows(rows: list[dict]) -> dict[str, torch.Tensor]:
    """A plain padding collator: the rows right-padded to one length with an attention mask (labels -100 and
    token type 0 on padding), the vision tensors concatenated in row order, audio clips (Omni) concatenated with
    their frames padded to the longest."""
    length = max(len(row["input_ids"]) for row in rows)
    batch = {"input_ids": torch.zeros(len(rows), length, dtype=torch.long),
             "labels": torch.full((len(rows), length), -100), "attention_mask": torch.zeros(len(rows), length,
                                                                                           dtype=torch.long)}
    if "mm_token_type_ids" in rows[0]:
        batch["mm_token_type_ids"] = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        batch["attention_mask"][i, :n] = 1
        for key in ("input_ids", "labels", "mm_token_type_ids"):
            if key in batch:
                batch[key][i, :n] = torch.as_tensor(row[key])
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
                "video_second_per_grid"):
        parts = [row[key] for row in rows if key in row]
        if parts:
            batch[key] = torch.cat(parts)
    clips = [row for row in rows if "input_features" in row]  # Omni audio: clips padded to the longest
    if clips:
        frames = max(row["input_features"].shape[-1] for row in clips)
        for key in ("input_features", "feature_attention_mask"):
            batch[key] = torch.cat([torch.nn.functional.pad(row[key], (0, frames - row[key].shape[-1]))
                                    for row in clips])
    return batch
