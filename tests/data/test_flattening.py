"""FlatteningCollator and the per-document M-RoPE positions of packed rows (issue #26, multimodal packing).

The parity check: the same 16 rows (images of different grids, rows without images; videos; for the Omni thinkers
audio clips of different lengths, with and without images, videos with and without their audio tracks) trained 4 AdamW
steps, 4 rows per step, packed into one row per batch by FlatteningCollator with mindspeed_hf enabled, against the
same rows right-padded by a plain collator through plain HF (disabled) and through mindspeed_hf: fp32 losses per
step within 1e-5, the first step's gradients within 1e-5. Torch and npu (stand-in)
backends. The controls show the check can fail: HF alone on the packed row, and the packed row with its M-RoPE
positions counted as one sequence (the mask still per document), both give other losses.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from tiny_omni import OMNI_TYPES, omni_rows, tiny_omni_thinker
from tiny_vlms import IMAGE, VIDEO, pad_rows, tiny_vlm, vlm_rows
from transformers import DataCollatorWithFlattening

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.data import FlatteningCollator
from mindspeed_hf.device import import_torch_npu
from mindspeed_hf.patches import packed_positions

ROWS, PER_STEP = 16, 4
AUDIO_IN_VIDEO = "audio_in_video"  # the Omni rows' videos with their audio tracks (use_audio_in_video=True)
# Qwen3.5 (hybrid linear attention): HF's own packed forward carries its linear layers' state across documents; the
# padded rows through plain HF are the reference here as for every family.
_NO_QWEN3_5 = pytest.mark.skipif(not hasattr(__import__("transformers"), "Qwen3_5ForConditionalGeneration"),
                                 reason="no Qwen3.5 in this transformers release")
# Qwen3-Omni's own padded forward with videos fails on transformers 4.57.6 (its deepstack features do not fit the
# video mask: a shape error inside HF, plain HF alone): the video cases run from transformers 5 on.
_OMNI_VIDEOS = pytest.mark.skipif(not hasattr(__import__("transformers"), "Qwen3_5ForConditionalGeneration"),
                                  reason="Qwen3-Omni's padded video forward fails in transformers 4.57 itself")
CASES = [("qwen2_vl", True), ("qwen2_5_vl", False), ("qwen2_5_vl", True), ("qwen3_vl", False), ("qwen3_vl", True),
         ("qwen3_vl_moe", True), pytest.param("qwen3_5", False, marks=_NO_QWEN3_5),
         pytest.param("qwen3_5", True, marks=_NO_QWEN3_5), pytest.param("qwen3_5_moe", True, marks=_NO_QWEN3_5),
         # the Omni thinkers: rows with audio clips and images, audio only, images only, neither; then with videos
         # (Qwen3-Omni's temporal positions are fractional), and videos carrying their own audio track
         *((model_type, False) for model_type in OMNI_TYPES),
         *(pytest.param(model_type, videos, marks=_OMNI_VIDEOS) for model_type in OMNI_TYPES
           for videos in (True, AUDIO_IN_VIDEO))]
_models: dict[str, torch.nn.Module] = {}
_references: dict[tuple[str, bool], dict] = {}


def _model(model_type: str) -> torch.nn.Module:
    """A fresh copy of one tiny model per type (built once: building is the slow part)."""
    if model_type not in _models:
        _models[model_type] = tiny_omni_thinker(model_type) if model_type in OMNI_TYPES else tiny_vlm(model_type)
    return copy.deepcopy(_models[model_type])


def _groups(model_type: str, videos: bool | str) -> list[list[dict]]:
    model = _models.get(model_type) or _model(model_type)
    if model_type in OMNI_TYPES:
        rows = omni_rows(model, count=ROWS, videos=bool(videos), audio_in_video=videos == AUDIO_IN_VIDEO)
    else:
        rows = vlm_rows(model, count=ROWS, videos=videos)
    return [rows[i:i + PER_STEP] for i in range(0, ROWS, PER_STEP)]


def _batches(collate, model_type: str, videos: bool | str) -> list[dict]:
    """Each step's rows through `collate`; a batch of videos with audio tracks says so (use_audio_in_video: a
    model argument, not a processor output)."""
    flag = {"use_audio_in_video": True} if videos == AUDIO_IN_VIDEO else {}
    return [{**collate(group), **flag} for group in _groups(model_type, videos)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine two threads spin-wait
    (measured: 2.5 s of CPU per step with two, 0.06 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train(model: torch.nn.Module, batches: list[dict]) -> dict:
    """AdamW steps, one per batch: the loss of each step and the first step's gradients (later gradients and the
    weights are not compared: Adam turns last-bit gradient differences of near-zero gradients into lr-sized
    weight differences, 5.8e-5 after 4 steps here)."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], None
    for batch in batches:
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.item())
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
    return {"losses": losses, "grads": grads}


def _reference(model_type: str, videos: bool) -> dict:
    """Plain HF (mindspeed_hf disabled) on the padded rows, computed once per case."""
    key = (model_type, videos)
    if key not in _references:
        assert not mindspeed_hf.is_enabled()
        _references[key] = _train(_model(model_type), _batches(pad_rows, model_type, videos))
    return _references[key]


def _accelerated(model_type: str, batches: list[dict], backend: str) -> dict:
    mindspeed_hf.enable(config_from_dict({"backend": backend}))
    model = _model(model_type)
    mindspeed_hf.apply_to_model(model)
    return _train(model, batches)


def _assert_same(run: dict, reference: dict, what: str) -> None:
    diffs = [abs(a - b) for a, b in zip(run["losses"], reference["losses"])]
    assert max(diffs) <= 1e-5, f"{what}: per-step loss differences {diffs}"
    assert run["grads"].keys() == reference["grads"].keys()
    worst = max((run["grads"][n] - reference["grads"][n]).abs().max().item() for n in reference["grads"])
    assert worst <= 1e-5, f"{what}: first-step gradients differ by {worst}"


@pytest.mark.parametrize(("model_type", "videos"), CASES)
def test_packed_equals_padded(model_type, videos, backend, monkeypatch):
    reference = _reference(model_type, videos)
    groups = _groups(model_type, videos)
    packed = _batches(FlatteningCollator(), model_type, videos)
    assert all(b["input_ids"].shape[0] == 1 and "attention_mask" not in b for b in packed)
    calls = []
    if backend == "npu":
        npu = import_torch_npu()
        real = npu.npu_fusion_attention

        def counting(*args, **kwargs):
            if kwargs.get("atten_mask") is not None:  # the text attention (causal); the vision tower's has none
                calls.append((args[4], tuple(kwargs.get("actual_seq_qlen") or ())))
            return real(*args, **kwargs)

        monkeypatch.setattr(npu, "npu_fusion_attention", counting)
    _assert_same(_accelerated(model_type, packed, backend), reference, f"packed ({backend})")
    if backend == "npu":  # the packed text attention ran as packed sequences (TND), one document per row
        lengths = [torch.tensor([len(r["input_ids"]) for r in g]).cumsum(0).tolist() for g in groups]
        assert calls and {layout for layout, _ in calls} == {"TND"}
        text = _models[model_type].config.text_config  # one call per attention layer (not the linear ones)
        layers = text.num_hidden_layers - list(getattr(text, "layer_types", None) or []).count("linear_attention")
        assert [list(ends) for _, ends in calls[::layers]] == lengths[:len(calls[::layers])]
    else:
        mindspeed_hf.disable()
        padded = _accelerated(model_type, _batches(pad_rows, model_type, videos), backend)
        _assert_same(padded, reference, "padded with mindspeed_hf")


def _first_loss(model_type: str, batch: dict) -> float:
    return _model(model_type)(**batch).loss.item()


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", *OMNI_TYPES])
def test_controls_without_per_document_positions(model_type, monkeypatch):
    """The parity above can fail: HF alone on the packed row (one sequence: no packed mask, text positions on the
    three rope rows), and the packed row with the packed mask but without the documents' M-RoPE positions (their
    text positions on the three rows, what HF makes of 2-D position ids), both miss the padded loss."""
    reference = _reference(model_type, False)["losses"][0]
    batch = FlatteningCollator()(_groups(model_type, False)[0])
    assert abs(_model(model_type)(**batch).loss.item() - reference) > 1e-3

    def text_rows_only(model, input_ids, text_positions, arguments, spans=None):
        return text_positions.expand(input_ids.shape[0], -1).unsqueeze(0).repeat(4, 1, 1)

    monkeypatch.setattr(packed_positions, "packed_rope_positions", text_rows_only)
    packed = [FlatteningCollator()(g) for g in _groups(model_type, False)]
    with pytest.raises(AssertionError, match="per-step loss differences"):
        _assert_same(_accelerated(model_type, packed, "torch"), _reference(model_type, False), "control")


def test_rope_positions_restart_per_document():
    """Each document's three rope rows are HF's get_rope_index on that document alone (they restart at 0)."""
    model = _model("qwen2_5_vl")
    rows = _groups("qwen2_5_vl", True)[0]
    batch = FlatteningCollator()(rows)
    positions = packed_positions.packed_rope_positions(model.model, batch["input_ids"], batch["position_ids"], batch)
    assert positions.shape == (4, 1, batch["input_ids"].shape[1])
    assert torch.equal(positions[0], batch["position_ids"])
    padded = pad_rows(rows)
    names = inspect.signature(model.model.get_rope_index).parameters  # 4.57 takes no mm_token_type_ids
    expected, _ = model.model.get_rope_index(**{k: v for k, v in padded.items() if k in names and k != "labels"})
    keep = padded["attention_mask"].bool()
    assert torch.equal(positions[1:, 0], torch.cat([expected[:, i, keep[i]] for i in range(len(rows))], dim=1))


def test_audio_clips_follow_row_order_padded_to_the_longest():
    """The Omni rows' clips are concatenated in row order, frames right-padded (features 0, mask 0); a row's one
    clip may come as [mel, frames]."""
    rows = omni_rows(_model("qwen2_5_omni_thinker"), count=4)
    single = {**rows[3], "input_features": rows[3]["input_features"][0],
              "feature_attention_mask": rows[3]["feature_attention_mask"][0]}
    batch = FlatteningCollator()([*rows[:3], single])
    clips = [(row["input_features"][i], row["feature_attention_mask"][i]) for row in rows
             for i in range(len(row.get("feature_attention_mask", ())))]
    assert batch["input_features"].shape == (len(clips), clips[0][0].shape[0], max(m.shape[0] for _, m in clips))
    for (features, mask), got, got_mask in zip(clips, batch["input_features"], batch["feature_attention_mask"]):
        n = mask.shape[0]
        assert torch.equal(got[:, :n], features) and not got[:, n:].any()
        assert torch.equal(got_mask[:n], mask) and not got_mask[n:].any()


def test_text_fields_are_hf_collators_and_vision_fields_follow_row_order():
    rows = _groups("qwen2_5_vl", True)[0]
    options = dict(return_flash_attn_kwargs=True, return_seq_idx=True, separator_id=-7)
    batch = FlatteningCollator(**options)(rows)
    text = DataCollatorWithFlattening(return_tensors="pt", **options)(rows)
    for key, value in text.items():
        assert torch.equal(torch.as_tensor(batch[key]), torch.as_tensor(value)), key
    padded = pad_rows(rows)
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        assert torch.equal(batch[key], padded[key]), key
    if "mm_token_type_ids" not in rows[0]:  # transformers 4.57: the models take no token types
        assert "mm_token_type_ids" not in batch
        return
    types = batch["mm_token_type_ids"][0]
    assert types.shape == batch["input_ids"][0].shape
    assert torch.equal(types == 1, batch["input_ids"][0] == IMAGE) and torch.equal(types == 2,
                                                                                   batch["input_ids"][0] == VIDEO)


def test_refusals():
    rows = _groups("qwen2_5_vl", False)[0]
    with pytest.raises(ValueError, match="row 0 has input_features without feature_attention_mask"):
        FlatteningCollator()([{**rows[0], "input_features": torch.zeros(1, 16, 8)}])
    with pytest.raises(ValueError, match=r"row 1: input_features \[2, 16, 8\] and feature_attention_mask \[2, 7\]"):
        clip = {"input_features": torch.zeros(2, 16, 8), "feature_attention_mask": torch.ones(2, 7)}
        FlatteningCollator()([rows[0], {**rows[1], **clip}])
    with pytest.raises(ValueError, match="return_position_ids=False with vision inputs"):
        FlatteningCollator(return_position_ids=False)(rows)
    with pytest.raises(ValueError, match="mm_token_type_ids is given for some rows"):
        typed = {**rows[0], "mm_token_type_ids": [0] * len(rows[0]["input_ids"])}
        FlatteningCollator()([typed, {k: v for k, v in rows[1].items() if k != "mm_token_type_ids"}])
    with pytest.raises(ValueError, match=r"row 0: input_ids of shape \[2, 5\]; each feature is one row"):
        FlatteningCollator()([{"input_ids": torch.ones(2, 5, dtype=torch.long)}])


def test_a_processors_one_example_rows_are_rows():
    """A processor called on one example returns its text fields [1, tokens]: the same batch as the rows' 1-D
    fields (HF's processor itself: tests/data/test_omni_processor.py)."""
    rows = _groups("qwen2_5_vl", False)[0]
    batched = [{**row, **{k: torch.as_tensor(row[k])[None] for k in ("input_ids", "labels") if k in row}}
               for row in rows]
    want, got = FlatteningCollator()(rows), FlatteningCollator()(batched)
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


def test_disable_restores_hf_forward():
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as modeling

    original = vars(modeling.Qwen2_5_VLModel)["forward"]
    mindspeed_hf.enable()
    assert vars(modeling.Qwen2_5_VLModel)["forward"] is not original
    mindspeed_hf.disable()
    assert vars(modeling.Qwen2_5_VLModel)["forward"] is original


def test_trainer_packed_equals_padded(tmp_path):
    """The drop-in use: a plain transformers.Trainer (4 rows a step, shuffled with one seed) with
    FlatteningCollator and mindspeed_hf enabled logs the losses of the same Trainer on padded rows, plain HF."""
    from transformers import Trainer, TrainingArguments

    rows = [row for group in _groups("qwen2_5_vl", True) for row in group]

    def logged_losses(collator) -> list[float]:
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=PER_STEP, max_steps=4,
                                 learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, report_to=[],
                                 save_strategy="no", seed=0, remove_unused_columns=False, use_cpu=True)
        trainer = Trainer(model=_model("qwen2_5_vl"), args=args, train_dataset=rows, data_collator=collator)
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    padded = logged_losses(pad_rows)
    mindspeed_hf.enable()
    packed = logged_losses(FlatteningCollator())
    assert len(packed) == len(padded) == 4
    assert max(abs(a - b) for a, b in zip(packed, padded)) <= 1e-5, (packed, padded)
