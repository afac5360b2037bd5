"""Recompute (memory.recompute) with every kernel on gives the plain HF model's loss and gradients."""

import torch
from tiny_models import assert_close_grads, loss_and_grads, padded_batch, tiny_model

import mindspeed_hf
from mindspeed_hf.memory import enable_recompute


def test_recompute_keeps_loss_and_grads(backend):
    model = tiny_model("qwen3")
    model.train()
    batch = padded_batch()
    expected = loss_and_grads(model, batch)
    mindspeed_hf.enable(mindspeed_hf.load_config({"backend": backend}))
    mindspeed_hf.apply_to_model(model)
    enable_recompute(model)
    assert model.is_gradient_checkpointing
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)
