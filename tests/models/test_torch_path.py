"""kernels.torch_path: auto (the default) on the torch backend: HF's own code runs the ops where ours is slower there
(RMSNorm, SwiGLU, the loss of a small vocabulary) in a single-process model, report() names them and why, what ran
counts only ours, and the results are plain HF's. Attention, rope and a large vocabulary's loss stay ours; the device
backends, `fused` and tensor / context / expert parallelism run ours everywhere."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_models import assert_close_grads, loss_and_grads, packed_batch, padded_batch, tiny_model

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.patches import choice
from mindspeed_hf.runtime import watch

pytestmark = pytest.mark.torch_path_auto

SMALL_VOCAB_CHOICES = {"rms_norm", "swiglu", "fused_linear_cross_entropy"}


def _batches():
    return {"padded": padded_batch(), "packed": packed_batch()}


def test_hf_code_runs_where_ours_gains_nothing_and_the_results_are_hf(caplog):
    model = tiny_model("qwen3")  # shared key/value heads (4 / 2), vocabulary 128
    expected = {name: loss_and_grads(model, batch) for name, batch in _batches().items()}
    mindspeed_hf.enable()
    with caplog.at_level(logging.INFO, logger="mindspeed_hf"):
        report = mindspeed_hf.apply_to_model(model)
    assert set(report["hf_path"]) == SMALL_VOCAB_CHOICES
    assert all("no gain" in why for why in report["hf_path"].values())
    assert report["kernels"]["rms_norm"] == report["kernels"]["swiglu"] == 0
    assert report["kernels"]["fused_linear_cross_entropy"] == 0
    assert report["kernels"]["rope"] == report["kernels"]["attention"] == 2  # ours: rope and attention
    assert "HF's code where ours gains nothing here: rms_norm, swiglu, fused_linear_cross_entropy" in caplog.text
    for name, batch in _batches().items():
        loss, grads = loss_and_grads(model, batch)
        torch.testing.assert_close(loss, expected[name][0], atol=1e-5, rtol=1e-5)
        assert_close_grads(expected[name][1], grads)
    ran = mindspeed_hf.report(model)["ran"]
    assert ran["rope"] == ran["attention"] == 4 and ran["rms_norm"] == ran["swiglu"] == 0
    assert ran["fused_linear_cross_entropy"] == 0
    assert watch.idle_kernels(model, {})[0] == []  # nothing handed to HF is said to be idle


def test_a_large_vocabulary_keeps_the_chunked_loss():
    model = tiny_model("qwen3", num_key_value_heads=4, vocab_size=choice.SMALL_VOCAB + 1)  # no shared heads either
    batch = padded_batch()
    expected = loss_and_grads(model, batch)
    mindspeed_hf.enable()
    report = mindspeed_hf.apply_to_model(model)
    assert set(report["hf_path"]) == {"rms_norm", "swiglu"}
    assert report["attention_implementation"] == "mindspeed" and report["kernels"]["attention"] == 2
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)
    assert mindspeed_hf.report(model)["ran"]["fused_linear_cross_entropy"] == 1  # the chunked loss pays here


def test_a_model_built_while_enabled_follows_the_choice():
    mindspeed_hf.enable()
    model = tiny_model("qwen3")  # never given to apply_to_model or a trainer
    model(**padded_batch())
    ran = mindspeed_hf.report(model)["ran"]
    assert ran["rope"] == ran["attention"] == 2 and ran["rms_norm"] == ran["swiglu"] == 0
    assert ran["fused_linear_cross_entropy"] == 0
    assert set(mindspeed_hf.report(model)["hf_path"]) == SMALL_VOCAB_CHOICES


@pytest.mark.parametrize("settings", [{"kernels": {"torch_path": "fused"}}, {"backend": "npu"},
                                      {"parallel": {"tp": 2}}, {"parallel": {"cp": 2}}],
                         ids=["fused", "npu", "tp", "cp"])
def test_fused_the_device_backends_and_the_parallel_axes_run_ours(settings):
    model = tiny_model("qwen3")
    mindspeed_hf.enable(config_from_dict(settings))
    report = mindspeed_hf.apply_to_model(model)
    assert report["hf_path"] == {}
    assert report["attention_implementation"] == "mindspeed"
    model(**padded_batch())
    ran = mindspeed_hf.report(model)["ran"]
    assert all(ran[op] for op in ("rms_norm", "swiglu", "rope", "attention", "fused_linear_cross_entropy"))


@pytest.mark.parametrize("loss", [{"skip_logits": "always"}, {"loss_chunk_size": 16}])
def test_the_loss_settings_keep_the_fused_loss(loss):
    mindspeed_hf.enable(config_from_dict({"kernels": loss}))
    model = tiny_model("qwen3")
    report = mindspeed_hf.apply_to_model(model)
    assert set(report["hf_path"]) == {"rms_norm", "swiglu"}
    model(**padded_batch())
    assert mindspeed_hf.report(model)["ran"]["fused_linear_cross_entropy"] == 1


def test_a_switched_off_kernel_is_not_listed_as_handed_to_hf():
    mindspeed_hf.enable(config_from_dict({"kernels": {"rms_norm": False}}))
    report = mindspeed_hf.apply_to_model(tiny_model("qwen3"))
    assert set(report["hf_path"]) == {"swiglu", "fused_linear_cross_entropy"}


def test_interleaved_rope_is_hf_on_the_torch_backend_and_ours_when_fused():
    """DeepSeek-V3's interleaved rope: ours lays the pairs apart first, slower than HF's turn in place on the torch
    backend, so `auto` runs HF's there (named in hf_path); `fused` runs ours, HF's bits."""
    model = tiny_model("deepseek_v3")
    assert model.config.rope_interleave
    batch = padded_batch()
    expected = loss_and_grads(model, batch)
    for torch_path, ours in (("auto", False), ("fused", True)):
        mindspeed_hf.enable(config_from_dict({"kernels": {"torch_path": torch_path}}))
        report = mindspeed_hf.apply_to_model(model)
        assert ("rope" in report["hf_path"]) is not ours
        loss, grads = loss_and_grads(model, batch)
        torch.testing.assert_close(loss, expected[0], atol=0, rtol=0)
        assert_close_grads(expected[1], grads, atol=0, rtol=0)
        assert mindspeed_hf.report(model)["ran"]["rope"] == (model.config.num_hidden_layers if ours else 0)
        assert report["kernels"]["rope"] == (model.config.num_hidden_layers if ours else 0)
        assert watch.idle_kernels(model, {})[0] == []  # HF's rope is not said to be ours and idle
        mindspeed_hf.disable()
