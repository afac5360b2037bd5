"""Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE, LLaVA, InternVL): loss
and every gradient,
vision tower and language model alike, equal the plain HF model (fp32, 1e-5) on the torch and npu backends, with
several images of different grids per batch and right / left padded text; the vision tower's attention is one
varlen call per layer for all images; report() counts vision and text kernels apart."""

import pytest
import torch
from tiny_models import assert_close_grads, installed, loss_and_grads
from tiny_vlms import GRIDS, HYBRID_VL, QWEN_VL, VLM_TYPES, packed_vlm_batch, tiny_vlm, vlm_batch
from transformers import AutoModelForImageTextToText

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.device import import_torch_npu
from mindspeed_hf.patches import FAMILIES, experts

# Multiple loss chunks per batch; logits skipped outside Trainer too, so the fused loss is what runs.
CONFIG = {"kernels": {"skip_logits": "always", "loss_chunk_size": 16}}
OVERRIDES = {"qwen3_vl_moe": {"text_config": {"output_router_logits": True}}}


# Qwen3.5 (-MoE) exist from transformers 5.x on
TYPES = installed(VLM_TYPES)


def _full_attention_layers(text) -> int:
    """Layers with attention (and rope): all of them, except a hybrid model's linear-attention layers."""
    return text.num_hidden_layers - list(getattr(text, "layer_types", None) or []).count("linear_attention")


def _model(model_type: str):
    model = tiny_vlm(model_type)
    for key, values in OVERRIDES.get(model_type, {}).items():
        for name, value in values.items():
            setattr(getattr(model.config, key), name, value)
    return model


def _vision_calls(monkeypatch) -> list:
    """Record the npu_fusion_attention calls without a mask (the vision tower's: text attention is causal)."""
    npu = import_torch_npu()
    real, calls = npu.npu_fusion_attention, []

    def counting(*args, **kwargs):
        if kwargs.get("atten_mask") is None:
            calls.append((args[4], tuple(kwargs.get("actual_seq_qlen") or ())))
        return real(*args, **kwargs)

    monkeypatch.setattr(npu, "npu_fusion_attention", counting)
    return calls


def test_every_vlm_family_has_a_test_config():
    assert {t for t, f in FAMILIES.items() if f.vlm_heads and not f.audio_model} == set(VLM_TYPES)  # Omni: test_omni.py


@pytest.mark.parametrize("model_type", TYPES)
def test_vlm_parity(model_type, backend, monkeypatch):
    model = _model(model_type)
    batches = {"right": vlm_batch(model), "left": vlm_batch(model, left=True)}
    expected = {name: loss_and_grads(model, batch) for name, batch in batches.items()}
    calls = _vision_calls(monkeypatch)

    mindspeed_hf.enable(config_from_dict({"backend": backend, **CONFIG}))
    report = mindspeed_hf.apply_to_model(model)
    text = model.config.text_config
    kernels = report["kernels"]
    assert kernels["fused_linear_cross_entropy"] == 1
    # rope too on 4.57's Qwen2(.5)-VL, whose text attention calls its sectioned apply_multimodal_rotary_pos_emb
    assert kernels["attention"] == kernels["rope"] == _full_attention_layers(text) and kernels["rms_norm"] > 0
    assert kernels["linear_attention"] == text.num_hidden_layers - _full_attention_layers(text)
    # the experts kernel on the npu path (the torch backend runs transformers' grouped_mm, report()["kept"] says so)
    moe = model_type in ("qwen3_vl_moe", "qwen3_5_moe") and experts.available() and backend == "npu"
    assert kernels["experts"] == (text.num_hidden_layers if moe else 0)
    if model_type in QWEN_VL:
        depth = model.config.vision_config.depth
        vision = report["vision_kernels"]
        assert vision["attention"] == vision["rope"] == depth
        rms_tower = model_type == "qwen2_5_vl"  # two norms per block and the merger's ln_q; SwiGLU-with-bias MLPs
        assert (vision["rms_norm"], vision["swiglu"]) == ((2 * depth + 1, depth) if rms_tower else (0, 0))
        assert report["vision_attention_implementation"] == (
            "npu:npu_fusion_attention(TND)" if backend == "npu" else "torch:sdpa_by_length")
    else:
        assert "vision_kernels" not in report  # CLIP / InternViT towers run HF's code
    for name, batch in batches.items():
        calls.clear()
        model.train()
        assert type(model(**batch).logits).__name__ == "SkippedLogits"
        if backend == "npu" and model_type in QWEN_VL:
            # one TND call per vision layer for every image of the batch, not one per image
            assert [layout for layout, _ in calls] == ["TND"] * depth
            assert {ends[-1] for _, ends in calls} == {sum(t * h * w for t, h, w in GRIDS)}
            segments = [len(ends) for _, ends in calls]
            # Qwen2.5-VL: block 0 attends within windows (7 of 16 patches here), block 1 over whole images
            assert segments == ([7, len(GRIDS)] if model_type == "qwen2_5_vl" else [len(GRIDS)] * depth)
        loss, grads = loss_and_grads(model, batch)
        torch.testing.assert_close(loss, expected[name][0], atol=1e-5, rtol=1e-5, msg=f"{model_type} {name}")
        assert_close_grads(expected[name][1], grads)


@pytest.mark.parametrize("model_type", TYPES)
def test_vlm_packed_parity(model_type):
    """Both samples packed in one row (position ids restart; Qwen-VL: their 3-D M-RoPE positions after a text row,
    no attention mask): loss and gradients equal HF's on the same row, on the npu path (text attention there is
    TND over packed sequences; the torch path's is HF's sdpa). Not Qwen3.5: HF's packed forward runs its linear
    layers across the samples, so it is no reference (tests/data/test_flattening.py checks packed Qwen3.5 against
    the padded rows)."""
    if model_type in HYBRID_VL:
        pytest.skip("HF's packed forward is not the reference for a hybrid linear-attention model")
    model = _model(model_type)
    batch = packed_vlm_batch(model)
    expected = loss_and_grads(model, batch)
    mindspeed_hf.enable(config_from_dict({"backend": "npu", **CONFIG}))
    mindspeed_hf.apply_to_model(model)
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)


@pytest.mark.parametrize("model_type", ["qwen3_vl", "qwen2_5_vl"])
def test_shift_labels_and_num_items_honoured(model_type):
    """HF's Qwen3-VL head drops loss kwargs; ours uses pre-shifted labels and Trainer's token count like a causal
    LM does, equal to HF's ForCausalLMLoss on the plain model's logits."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = _model(model_type)
    batch = vlm_batch(model)
    labels = batch.pop("labels")
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    shift[0, 3] = -100  # differs from shifting `labels`, so a dropped shift_labels shows
    items = torch.tensor(int((shift != -100).sum()) + 5)
    model.zero_grad()
    logits = model(**batch).logits
    expected = ForCausalLMLoss(logits, None, model.config.text_config.vocab_size, shift_labels=shift,
                               num_items_in_batch=items)
    expected.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    mindspeed_hf.enable(config_from_dict(CONFIG))
    mindspeed_hf.apply_to_model(model)
    loss, ours = loss_and_grads(model, {**batch, "labels": labels, "shift_labels": shift,
                                        "num_items_in_batch": items})
    torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
    assert_close_grads(grads, ours)


def test_built_while_enabled_and_explicit_request_kept():
    """Built after enable(): text and vision get ours and match HF; an explicit attention request keeps HF's
    vision attention (and says so)."""
    plain = _model("qwen2_5_vl")
    batch = vlm_batch(plain, left=True)
    expected = loss_and_grads(plain, batch)
    mindspeed_hf.enable(config_from_dict(CONFIG))
    model = _model("qwen2_5_vl")
    report = mindspeed_hf.report(model)
    assert model.config.vision_config._attn_implementation == "mindspeed"
    assert report["vision_kernels"]["attention"] == 2 and report["kernels"]["attention"] == 2
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)

    torch.manual_seed(0)
    eager = AutoModelForImageTextToText.from_config(plain.config, attn_implementation="eager")
    report = mindspeed_hf.apply_to_model(eager)
    assert report["vision_kernels"]["attention"] == 0 and report["kernels"]["attention"] == 0
    assert "requested explicitly" in report["kept"]["attention"]


def test_disable_restores_vision_symbols():
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

    names = ("Qwen2_5_VLVisionAttention", "Qwen2_5_VLForConditionalGeneration")
    before = [getattr(m, n).forward for n in names] + [m.apply_rotary_pos_emb_vision]
    mindspeed_hf.enable()
    assert [getattr(m, n).forward for n in names] + [m.apply_rotary_pos_emb_vision] != before
    mindspeed_hf.disable()
    assert [getattr(m, n).forward for n in names] + [m.apply_rotary_pos_emb_vision] == before
