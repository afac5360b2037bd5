"""memory.recompute (full / selective) on every family: fp32 loss and every gradient bitwise equal to the same model
without recompute; it really recomputes (less kept for backward); the model's own config is current in the
recomputed forward; nothing is left that changes a later plain forward."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_models import FAMILY_CONFIGS, padded_batch, tiny_model

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.memory import remove_recompute
from mindspeed_hf.memory.measure import measure_forward
from mindspeed_hf.memory.recompute import decoder_layers
from mindspeed_hf.memory.selective import is_wrapped
from mindspeed_hf.parallel.parallelize import parallelize

FAMILIES = sorted(FAMILY_CONFIGS)
VARIANTS = {
    "attention_core": {"recompute": "selective", "recompute_modules": ["attention_core"]},
    "self_attn": {"recompute": "selective", "recompute_modules": ["self_attn"]},
    "mlp": {"recompute": "selective", "recompute_modules": ["mlp"]},
    "norms": {"recompute": "selective", "recompute_modules": ["norms"]},
    "selective_layer1": {"recompute": "selective", "recompute_modules": ["self_attn", "mlp", "norms"],
                         "recompute_layers": [1]},
    "full": {"recompute": "full"},
    "full_every2": {"recompute": True, "recompute_layers": 2},
}


def _prepared(model_type: str, memory: dict | None, lora: bool = False, **config):
    model = tiny_model(model_type)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
        with torch.no_grad():  # non-zero B so the adapters matter
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.05)
    model.train()
    cfg = config_from_dict({**config, "memory": memory or {}})
    mindspeed_hf.enable()
    mindspeed_hf.apply_to_model(model, cfg)
    return parallelize(model, None, cfg)


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_bitwise(expected, actual):
    assert torch.equal(expected[0], actual[0]), (expected[0].item(), actual[0].item())
    assert expected[1].keys() == actual[1].keys() and expected[1]
    for name, grad in expected[1].items():
        assert torch.equal(grad, actual[1][name]), name


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("model_type", FAMILIES)
def test_recompute_is_bitwise_equal(model_type, variant):
    batch = padded_batch()
    expected = _loss_and_grads(_prepared(model_type, None), batch)
    model = _prepared(model_type, VARIANTS[variant])
    _assert_bitwise(expected, _loss_and_grads(model, batch))
    layers = decoder_layers(model)
    if variant.startswith("full"):
        assert [layer.gradient_checkpointing for layer in layers] == [True, variant == "full"]
    else:
        wrapped = [any(is_wrapped(c) for c in layer.children()) for layer in layers]
        assert wrapped == [variant != "selective_layer1", True]


@pytest.mark.parametrize("variant", ["attention_core", "self_attn", "mlp", "full"])
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "gemma2"])
def test_recompute_with_lora(model_type, variant):
    batch = padded_batch()
    expected = _loss_and_grads(_prepared(model_type, None, lora=True), batch)
    _assert_bitwise(expected, _loss_and_grads(_prepared(model_type, VARIANTS[variant], lora=True), batch))


def test_npu_backend_selective(backend):
    batch = padded_batch()
    expected = _loss_and_grads(_prepared("qwen3", None, backend=backend), batch)
    memory = {"recompute": "selective", "recompute_modules": ["attention_core", "mlp", "norms"]}
    _assert_bitwise(expected, _loss_and_grads(_prepared("qwen3", memory, backend=backend), batch))


def _kept(memory: dict | None) -> tuple:
    model = _prepared("qwen3", memory)
    batch = padded_batch(seq=32)
    loss, kept = measure_forward(model, lambda: model(**batch).loss)
    loss.backward()
    return kept


def test_selective_keeps_less_than_none_and_full_less_still():
    none, full = _kept(None), _kept({"recompute": "full"})
    selective = {name: _kept(VARIANTS[name]) for name in ("attention_core", "self_attn", "mlp", "norms")}
    default = _kept({"recompute": "selective"})
    for name, kept in {**selective, "default": default}.items():
        assert kept.saved_bytes < none.saved_bytes, name
        assert kept.alive_bytes < none.alive_bytes, name
        assert full.alive_bytes < kept.alive_bytes, name
    assert selective["self_attn"].alive_bytes < selective["attention_core"].alive_bytes


def test_config_of_the_model_is_current_in_the_recomputed_forward(monkeypatch):
    """Two models, two configs: the recomputation in backward runs each model's own kernels."""
    from mindspeed_hf.patches import scope

    seen: list[tuple[bool, bool]] = []
    original = scope.current

    def spy():
        config = original()
        seen.append((torch.is_grad_enabled(), config.kernels.rms_norm))
        return config

    memory = {"recompute": "selective", "recompute_modules": ["self_attn", "mlp", "norms"]}
    off = _prepared("qwen3", memory, kernels={"rms_norm": False})
    on = _prepared("qwen3", memory)
    batch = padded_batch()
    expected_off = _loss_and_grads(_prepared("qwen3", None, kernels={"rms_norm": False}), batch)
    monkeypatch.setattr(scope, "current", spy)
    loss = off(**batch).loss
    seen.clear()
    loss.backward()  # the recomputation of `off`'s parts
    assert seen and all(rms is False for _, rms in seen)
    monkeypatch.setattr(scope, "current", original)
    _assert_bitwise(expected_off, _loss_and_grads(off, batch))
    _assert_bitwise(_loss_and_grads(_prepared("qwen3", None), batch), _loss_and_grads(on, batch))


def test_nothing_left_after_remove_and_plain_forward_unchanged():
    batch = padded_batch()
    model = _prepared("llama", VARIANTS["selective_layer1"])
    with torch.no_grad():
        wrapped_eval = model.eval()(**batch).logits
    remove_recompute(model)
    assert not any("forward" in m.__dict__ or is_wrapped(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, wrapped_eval)


def test_reapplying_replaces_and_selective_turns_whole_layer_checkpointing_off(caplog):
    model = _prepared("qwen3", {"recompute": "full"})
    assert all(layer.gradient_checkpointing for layer in decoder_layers(model))
    with caplog.at_level(logging.INFO, logger="mindspeed_hf"):
        parallelize(model, None, config_from_dict({"memory": {"recompute": "selective"}}))
    assert not any(layer.gradient_checkpointing for layer in decoder_layers(model))
    assert "replaces the whole-layer checkpointing" in caplog.text
    parallelize(model, None, config_from_dict({"memory": {"recompute": "selective", "recompute_modules": ["mlp"]}}))
    assert [is_wrapped(layer.mlp) for layer in decoder_layers(model)] == [True, True]
    assert not any(is_wrapped(layer.self_attn) for layer in decoder_layers(model))


def test_layer_index_past_the_model_fails_naming_the_setting():
    with pytest.raises(ValueError, match=r"memory.recompute_layers=\[5\]: the model has 2 decoder layers"):
        _prepared("qwen3", {"recompute": "selective", "recompute_layers": [5]})


def test_report_counts_the_kernels_under_selective_recompute():
    """report()'s patched sites are the same with every part recomputed as without (its wrappers run the class
    forwards, kernels included), and nothing is taken for a replacement of our kernels."""
    from mindspeed_hf.patches import apply

    plain = mindspeed_hf.report(_prepared("llama", None))["kernels"]
    model = _prepared("llama", {"recompute": "selective", "recompute_modules": ["self_attn", "mlp", "norms"]})
    assert sum(is_wrapped(m) for m in model.modules()) > 0
    assert mindspeed_hf.report(model)["kernels"] == plain and plain["swiglu"] > 0 and plain["rms_norm"] > 0
    assert apply.replacements(model) == {}
