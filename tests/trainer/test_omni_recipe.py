"""The Omni data path and `mindspeed-hf train --recipe omni`, against plain Hugging Face: the generated rows are the
same for the same seed, labels are -100 exactly off the answer, each clip's placeholder count is Qwen2.5-Omni's own
rule (its processor's, and what its audio tower returns), a padded batch gives every row the logits of that row run
alone, `--recipe omni` refuses a CONFIG in one line, and (slow) a short accelerated run has plain HF's per-step
losses while a 200-step run learns and writes a checkpoint that AutoModelForImageTextToText loads."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import cli
from transformers import AutoModelForImageTextToText, Qwen2_5_VLForConditionalGeneration

from mindspeed_hf.cli import main as cli_main
from mindspeed_hf.recipes import summary
from mindspeed_hf.recipes.data import IGNORE_INDEX
from mindspeed_hf.recipes.omni import IMAGE_SIZE, N_EVAL, omni_datasets, tiny_omni_config
from mindspeed_hf.recipes.omni_data import (
    AUDIO_PAD,
    IMAGE_PAD,
    MEL_BINS,
    OMNI_QUESTIONS,
    OmniCollator,
    audio_token_rule,
    encode_omni,
    make_omni_examples,
    make_omni_tokenizer,
)
from mindspeed_hf.recipes.vl_data import PatchLayout, takes_mm_token_types

NEW = takes_mm_token_types(Qwen2_5_VLForConditionalGeneration)
needs_5 = pytest.mark.skipif(not NEW, reason="the Omni recipe needs transformers >= 5 (rope_parameters configs)")


@pytest.fixture(scope="module")
def thinker():
    """The recipe's tiny thinker (plain HF: the test process does not patch), its tokenizer and 6 encoded rows."""
    tokenizer = make_omni_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(tiny_omni_config(tokenizer)).eval()
    raw = make_omni_examples(6, IMAGE_SIZE, 11)
    rows = [encode_omni(r, tokenizer, PatchLayout.of(model.config.vision_config), audio_token_rule(model))
            for r in raw]
    return model, tokenizer, raw, rows


def test_examples_are_deterministic_per_seed():
    first, again, other = (make_omni_examples(12, IMAGE_SIZE, s) for s in (5, 5, 6))
    for a, b in zip(first, again):
        assert a["question"] == b["question"] and a["answer"] == b["answer"]
        assert torch.equal(a["audio"], b["audio"]) and torch.equal(a["image"], b["image"])
    assert any(not torch.equal(a["audio"], b["audio"]) for a, b in zip(first, other))
    assert {r["kind"] for r in make_omni_examples(60, IMAGE_SIZE, 3)} == set(OMNI_QUESTIONS)
    assert all(r["audio"].shape[0] == MEL_BINS for r in first)


@needs_5
def test_labels_are_the_answer_and_eos_only(thinker):
    _, tokenizer, raw, rows = thinker
    batch = OmniCollator(tokenizer.pad_token_id)(rows)
    for i, (row, encoded) in enumerate(zip(raw, rows)):
        answer = tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        n = len(encoded["input_ids"])
        expected = torch.full_like(batch["labels"][i], IGNORE_INDEX)
        expected[n - len(answer):n] = torch.tensor(answer)  # the answer closes the row; then padding
        assert torch.equal(batch["labels"][i], expected)
        assert batch["input_ids"][i, n - len(answer):n].tolist() == answer
        assert batch["attention_mask"][i].sum() == n


@needs_5
def test_audio_placeholders_follow_the_models_rule(thinker):
    """Each row's <|AUDIO|> count is Qwen2.5-Omni's processor rule for its clip's frames, and the audio tower
    returns exactly that many features for the padded batch (HF's forward would refuse a mismatch)."""
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import _get_feat_extract_output_lengths

    model, tokenizer, raw, rows = thinker
    batch = OmniCollator(tokenizer.pad_token_id)(rows)
    frames = torch.tensor([r["audio"].shape[1] for r in raw])
    assert torch.equal(batch["feature_attention_mask"].sum(-1), frames)
    counts = (batch["input_ids"] == tokenizer.convert_tokens_to_ids(AUDIO_PAD)).sum(-1)
    assert torch.equal(counts, _get_feat_extract_output_lengths(frames))
    assert len(set(counts.tolist())) > 1, "clips of different lengths"
    with torch.no_grad():
        features = model.get_audio_features(batch["input_features"], batch["feature_attention_mask"],
                                            return_dict=True).last_hidden_state
    assert features.shape[0] == int(counts.sum())
    images = (batch["input_ids"] == tokenizer.convert_tokens_to_ids(IMAGE_PAD)).sum(-1)
    assert torch.equal(images, batch["image_grid_thw"].prod(-1) // 4)


@needs_5
def test_collator_zero_pads_the_clips(thinker):
    _, tokenizer, raw, rows = thinker
    batch = OmniCollator(tokenizer.pad_token_id)(rows)
    longest = max(r["audio"].shape[1] for r in raw)
    assert batch["input_features"].shape == (len(rows), MEL_BINS, longest)
    for i, row in enumerate(raw):
        n = row["audio"].shape[1]
        assert torch.equal(batch["input_features"][i, :, :n], row["audio"])
        assert not batch["input_features"][i, :, n:].any()


@needs_5
def test_padded_batch_gives_each_row_its_own_logits(thinker):
    """Plain HF: the padded batch (clips of different lengths, text of different lengths) equals each row alone."""
    model, tokenizer, _, rows = thinker
    collate = OmniCollator(tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(**{k: v for k, v in collate(rows).items() if k != "labels"}).logits
        for i, row in enumerate(rows):
            alone = model(**{k: v for k, v in collate([row]).items() if k != "labels"}).logits[0]
            n = len(row["input_ids"])
            torch.testing.assert_close(logits[i, :n], alone, rtol=1e-5, atol=1e-5)


def test_recipe_takes_no_config(capsys):
    """(The unknown-recipe line naming text, vl and omni: tests/trainer/test_vl_recipe.py.)"""
    assert cli_main.main(["train", "run.yaml", "--recipe", "omni"]) == 2
    assert "--recipe omni builds its own model and data and takes no CONFIG.yaml" in capsys.readouterr().err


@pytest.mark.skipif(NEW, reason="transformers >= 5 runs the Omni recipe")
def test_recipe_says_it_needs_transformers_5(capsys):
    assert cli_main.main(["train", "--recipe", "omni", "--max_steps", "1"]) == 2
    assert "--recipe omni needs transformers >= 5" in capsys.readouterr().err


def _run(tmp_path, name: str, auto: bool, *args: str) -> dict:
    metrics = tmp_path / f"{name}.json"
    proc = cli(["train", "--recipe", "omni", "--output_dir", str(tmp_path / name), "--metrics-file", str(metrics),
                "--disable_tqdm", "true", *args], auto=auto)
    result = json.loads(metrics.read_text())
    assert result["recipe"] == "omni" and result["accelerated"] is auto, proc.stdout
    return result


@pytest.mark.slow
@needs_5
def test_short_run_has_plain_hf_losses(tmp_path):
    """fp32: the accelerated recipe's per-step losses equal MINDSPEED_HF_AUTO=0's within 1e-5, with our kernels
    run in the text model and both towers."""
    steps = ["--max_steps", "6", "--logging_steps", "1", "--skip-quality-eval"]
    fast, plain = _run(tmp_path, "fast", True, *steps), _run(tmp_path, "plain", False, *steps)
    assert list(fast["losses"]) == list(plain["losses"]) == [str(s) for s in range(1, 7)]
    torch.testing.assert_close(torch.tensor(list(fast["losses"].values()), dtype=torch.float64),
                               torch.tensor(list(plain["losses"].values()), dtype=torch.float64), rtol=1e-5, atol=1e-5)
    ran = fast["report"]["ran"]
    assert all(ran[op] > 0 for op in ("rms_norm", "rope", "swiglu", "attention", "fused_linear_cross_entropy",
                                      "vision_attention"))
    assert fast["report"]["audio_kernels"]["attention"] == 2
    assert summary.applied(fast["report"]).endswith("audio tower: attention x2")  # the summary line names it
    assert not any(plain["report"]["kernels"].values())


@pytest.mark.slow
@needs_5
def test_recipe_learns_and_writes_a_loadable_checkpoint(tmp_path):
    """A shortened accelerated run lifts held-out exact match from 0 to well above chance (about 1/3 over the three
    questions), and the checkpoint, loaded by plain HF, scores exactly the accuracy the run printed."""
    from mindspeed_hf.recipes.vl import answer_accuracy

    result = _run(tmp_path, "out", True, "--max_steps", "200")
    assert result["steps"] == 200
    assert result["before"]["exact_match"] < 0.1
    assert result["after"]["exact_match"] > 0.8, result["after"]
    assert result["after"]["eval_loss"] < result["before"]["eval_loss"] / 10

    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "out")
    assert type(model).__name__ == "Qwen2_5OmniThinkerForConditionalGeneration"
    tokenizer = make_omni_tokenizer()
    _, held_out = omni_datasets(model, tokenizer, n_train=0)
    assert len(held_out) == N_EVAL == result["after"]["num_prompts"]
    accuracy = answer_accuracy(model, OmniCollator(tokenizer.pad_token_id), held_out)
    assert accuracy == pytest.approx(result["after"]["exact_match"], abs=1.5 / N_EVAL)
