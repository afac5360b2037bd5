"""A device kernel that hands a call to the torch path is counted as a fallback, not as its kernel: report()["ran"]
says what really ran on the device kernel and report()["fallbacks"] the calls that fell back; the loss still equals
plain HF's."""

from __future__ import annotations

import logging

import torch
from tiny_models import loss_and_grads, padded_batch, tiny_model

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.ops import attention
from mindspeed_hf.recipes.summary import applied
from mindspeed_hf.runtime import watch

HEAD_DIM = 800  # above npu_fusion_attention's 768: every attention call goes to the torch path on the npu backend


def test_attention_fallback_is_counted_apart_and_loss_equals_plain(caplog, monkeypatch):
    monkeypatch.setattr(attention, "_warned", set())  # one warning per reason and process: this test's own
    overrides = dict(head_dim=HEAD_DIM, num_attention_heads=2, num_key_value_heads=1)
    plain = tiny_model("qwen3", **overrides)
    batch = padded_batch()
    expected, expected_grads = loss_and_grads(plain, batch)

    mindspeed_hf.enable(config_from_dict({"backend": "npu"}))
    model = tiny_model("qwen3", **overrides)
    mindspeed_hf.apply_to_model(model)
    before = watch.snapshot(model)
    with caplog.at_level(logging.WARNING, logger="mindspeed_hf"):
        loss, grads = loss_and_grads(model, batch)
        watch.say_fallbacks(model, before, "during train()")  # the end-of-train line (Trainer, accelerate loop)
    report = mindspeed_hf.report(model)

    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5)
    layers = model.config.num_hidden_layers
    assert report["attention_implementation"] == "mindspeed"
    assert report["ran"]["attention"] == 0  # the fused op never ran
    assert report["fallbacks"] == {"attention": layers}
    assert report["ran"]["rms_norm"] > 0  # the other kernels did
    assert "fell back to the torch path: attention x" in applied(report)
    messages = [r.getMessage() for r in caplog.records]
    assert any("npu_fusion_attention cannot run" in m for m in messages)
    assert f"mindspeed_hf: during train(), attention x{layers} fell back to the torch path" in " ".join(messages)


def test_no_fallback_on_a_supported_shape():
    mindspeed_hf.enable(config_from_dict({"backend": "npu"}))
    model = tiny_model("qwen3")
    mindspeed_hf.apply_to_model(model)
    loss_and_grads(model, padded_batch())
    report = mindspeed_hf.report(model)
    assert report["fallbacks"] == {}
    assert report["ran"]["attention"] == model.config.num_hidden_layers
