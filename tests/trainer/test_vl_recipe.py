"""The VL data path and `mindspeed-hf train --recipe vl`, against plain Hugging Face: image patch rows equal
transformers' Qwen2VLImageProcessor, a padded VLCollator batch gives every row the logits of that example run alone
(3-D M-RoPE positions included: without mm_token_type_ids they differ), the text packer refuses image rows, a bad
recipe is one line, and the recipe learns and writes a checkpoint that AutoModelForImageTextToText loads."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import cli
from transformers import AutoModelForImageTextToText, Qwen2_5_VLForConditionalGeneration

from mindspeed_hf.cli import main as cli_main
from mindspeed_hf.recipes.data import IGNORE_INDEX, pack
from mindspeed_hf.recipes.vl_data import (
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    PatchLayout,
    VLCollator,
    draw,
    encode_vl,
    make_examples,
    make_tokenizer,
    patchify,
    takes_mm_token_types,
)

NEW_VL = takes_mm_token_types(Qwen2_5_VLForConditionalGeneration)
needs_new_vl = pytest.mark.skipif(not NEW_VL, reason="the VL recipe needs transformers >= 5 (Qwen-VL forward "
                                                     "with mm_token_type_ids)")


def _hf_image_processor():
    try:  # transformers 5 without torchvision: the PIL backend; 4.57: the slow (numpy) processor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as cls
    except ImportError:
        from transformers import Qwen2VLImageProcessor as cls
    return cls


@pytest.mark.parametrize("size", [(32, 32), (16, 48)])
def test_patch_rows_equal_hf_image_processor(size):
    height, width = size
    image = torch.randint(0, 256, (3, height, width), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    pixels = height * width
    processor = _hf_image_processor()(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=pixels,
                                      max_pixels=pixels, size={"shortest_edge": pixels, "longest_edge": pixels})
    expected = processor(images=[image.permute(1, 2, 0).numpy()], return_tensors="pt")
    rows, grid = patchify(image, PatchLayout())
    assert grid == tuple(expected["image_grid_thw"][0].tolist())
    torch.testing.assert_close(rows, expected["pixel_values"].float(), rtol=0, atol=1e-6)


def test_patchify_refuses_sizes_the_merger_cannot_cut():
    with pytest.raises(ValueError, match="multiple of patch_size \\* merge_size = 8"):
        patchify(torch.zeros(3, 12, 16, dtype=torch.uint8), PatchLayout())


def _rows(tokenizer, sizes=(32, 16, 24)) -> list[dict]:
    rng = random.Random(0)
    raw = [{"image": draw("red", "circle", "bottom right", s, rng), "question": "where is the shape ?",
            "answer": "bottom right"} for s in sizes]
    raw[1]["question"], raw[1]["answer"] = "what colour is the shape ?", "red"
    return [encode_vl(r, tokenizer, PatchLayout()) for r in raw]


def test_collator_pads_and_carries_the_vision_fields():
    tokenizer = make_tokenizer()
    rows = _rows(tokenizer)
    batch = VLCollator(tokenizer.pad_token_id)(rows)
    lengths = [len(r["input_ids"]) for r in rows]
    assert batch["input_ids"].shape == batch["labels"].shape == batch["mm_token_type_ids"].shape == (3, max(lengths))
    assert batch["image_grid_thw"].tolist() == [[1, 8, 8], [1, 4, 4], [1, 6, 6]]
    torch.testing.assert_close(batch["pixel_values"], torch.cat([r["pixel_values"] for r in rows]), rtol=0, atol=0)
    image = batch["input_ids"] == tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert image.sum(1).tolist() == [16, 4, 9]
    assert torch.equal(batch["mm_token_type_ids"].bool(), image)
    special = image | (batch["input_ids"] == tokenizer.convert_tokens_to_ids(VISION_START)) | (
        batch["input_ids"] == tokenizer.convert_tokens_to_ids(VISION_END))
    padding = batch["attention_mask"] == 0
    assert padding.sum(1).tolist() == [max(lengths) - n for n in lengths]
    assert (batch["labels"][special | padding] == IGNORE_INDEX).all()
    answers = [tokenizer.decode(batch["labels"][i][batch["labels"][i] != IGNORE_INDEX]) for i in range(3)]
    assert answers == ["bottom right <eos>", "red <eos>", "bottom right <eos>"]


def test_packing_refuses_image_rows():
    rows = _rows(make_tokenizer())
    with pytest.raises(ValueError, match="data.packing: image examples .* set data.packing: false"):
        pack(rows, 128)
    with pytest.raises(ValueError, match="set data.packing: false"):
        VLCollator(0)([{**rows[0], "position_ids": list(range(len(rows[0]["input_ids"])))}])


@needs_new_vl
def test_padded_batch_gives_each_row_its_own_logits():
    """Plain HF Qwen2.5-VL: a padded batch of three images of different grids equals each example alone (fp32,
    1e-5); dropping mm_token_type_ids changes the logits (1-D positions), so the collator's field is what counts."""
    from mindspeed_hf.recipes.vl import tiny_vl_config

    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(tiny_vl_config(tokenizer)).eval()
    rows = _rows(tokenizer)
    collate = VLCollator(tokenizer.pad_token_id)
    batch = collate(rows)
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        for i, row in enumerate(rows):
            alone = collate([row])
            n = len(row["input_ids"])
            expected = model(**{k: v for k, v in alone.items() if k != "labels"}).logits[0]
            torch.testing.assert_close(logits[i, :n], expected, rtol=1e-5, atol=1e-5)
        untyped = {k: v for k, v in batch.items() if k not in ("labels", "mm_token_type_ids")}
        assert (model(**untyped).logits - logits).abs().max() > 1e-3


def test_unknown_recipe_is_one_line(capsys):
    assert cli_main.main(["train", "--recipe", "vlm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "mindspeed-hf train: error: --recipe 'vlm' is not valid; choose one of text, vl, omni, diffusion"
    assert cli_main.main(["train", "run.yaml", "--recipe", "vl"]) == 2
    assert "--recipe vl builds its own model and data and takes no CONFIG.yaml" in capsys.readouterr().err


@pytest.mark.skipif(NEW_VL, reason="transformers >= 5 runs the VL recipe")
def test_recipe_says_it_needs_transformers_5(capsys):
    assert cli_main.main(["train", "--recipe", "vl", "--max_steps", "1"]) == 2
    assert "--recipe vl needs transformers >= 5" in capsys.readouterr().err


@needs_new_vl
def test_recipe_learns_and_writes_a_loadable_checkpoint(tmp_path):
    """A shortened recipe run (accelerated) lifts held-out exact match from 0 to well above chance (25%), and the
    checkpoint, loaded by plain HF, scores exactly the accuracy the run printed."""
    from mindspeed_hf.recipes.vl import N_EVAL, answer_accuracy, vl_datasets

    metrics = tmp_path / "metrics.json"
    proc = cli(["train", "--recipe", "vl", "--max_steps", "100", "--output_dir", str(tmp_path / "out"),
                "--metrics-file", str(metrics), "--disable_tqdm", "true"])
    assert "exact match" in proc.stdout and "AutoModelForImageTextToText.from_pretrained loads it" in proc.stdout
    result = json.loads(metrics.read_text())
    assert result["recipe"] == "vl" and result["accelerated"] and result["steps"] == 100
    assert result["before"]["exact_match"] < 0.1
    assert result["after"]["exact_match"] > 0.4, result["after"]
    assert result["after"]["eval_loss"] < result["before"]["eval_loss"] / 3

    tokenizer = make_tokenizer()
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "out")
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    _, held_out = vl_datasets(tokenizer, PatchLayout.of(model.config.vision_config), True, n_train=0)
    assert len(held_out) == N_EVAL == result["after"]["num_prompts"]
    accuracy = answer_accuracy(model, VLCollator(tokenizer.pad_token_id), held_out)
    assert accuracy == pytest.approx(result["after"]["exact_match"], abs=1.5 / N_EVAL)


def test_examples_cover_every_question():
    rows = make_examples(200, 16, 3)
    answers = {r["answer"] for r in rows}
    assert {"red", "green", "blue", "yellow", "top left", "top right", "bottom left", "bottom right"} <= answers
