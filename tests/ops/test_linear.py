"""Stacked projections (ops/linear.py): on the npu backend plain nn.Linear layers on one input run as one matmul
with HF's outputs and gradients (and HF's dtypes under autocast), without keeping the stacked weight for backward;
anything that is not a plain layer, and the torch backend, runs each layer as HF does. In a model: q/k/v and
gate/up stacked on npu, HF's loss and gradients, and report() says what ran."""

from __future__ import annotations

import pytest
import torch
from tiny_models import assert_close_grads, loss_and_grads, padded_batch, tiny_model
from torch import nn

import mindspeed_hf
from mindspeed_hf.ops import linear, registry


def _layers(bias: bool, in_features: int = 16, outs=(8, 4, 4)) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(in_features, n, bias=bias) for n in outs]


def _outputs_and_grads(fn, x, layers, autocast: bool = False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        outs = fn(x, layers)
        loss = sum((o.float() * torch.linspace(-1, 1, o.shape[-1])).sum() for o in outs)
    loss.backward()
    grads = [x.grad] + [p.grad for layer in layers for p in layer.parameters()]
    result = [o.detach().clone() for o in outs], [g.clone() for g in grads]
    x.grad = None
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    return result


@pytest.mark.parametrize("bias", [False, True])
def test_stacked_projections_equal_hf_layers(bias):
    registry.set_backend("npu")
    try:
        layers = _layers(bias)
        x = torch.randn(2, 5, 16, requires_grad=True)
        ran = {}
        token = registry.count_into(ran)
        want, want_grads = _outputs_and_grads(lambda x, ls: tuple(layer(x) for layer in ls), x, layers)
        got, got_grads = _outputs_and_grads(linear.project, x, layers)
        registry.stop_counting(token)
        assert ran == {"stacked_linear": 1}
        for a, b in zip(got + got_grads, want + want_grads):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        # bf16 autocast: HF's dtypes (bf16 outputs, fp32 gradients of fp32 parameters), values within bf16 rounding
        want, want_grads = _outputs_and_grads(lambda x, ls: tuple(layer(x) for layer in ls), x, layers, True)
        got, got_grads = _outputs_and_grads(linear.project, x, layers, True)
        assert [t.dtype for t in got + got_grads] == [t.dtype for t in want + want_grads]
        for a, b in zip(got + got_grads, want + want_grads):
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    finally:
        registry.set_backend(None)


def test_the_stacked_weight_is_not_kept_for_backward():
    registry.set_backend("npu")
    try:
        layers = _layers(False, in_features=32, outs=(64, 16, 16))
        x = torch.randn(3, 32, requires_grad=True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            linear.project(x, layers)
        assert (96, 32) not in saved and (32, 96) not in saved, saved
    finally:
        registry.set_backend(None)


def test_only_plain_layers_on_the_npu_backend_are_stacked():
    x = torch.randn(4, 16)
    layers = _layers(False)
    registry.set_backend("torch")
    try:
        ran = {}
        token = registry.count_into(ran)
        linear.project(x, layers)
        registry.stop_counting(token)
        assert ran == {}  # the torch backend runs HF's layers
    finally:
        registry.set_backend(None)
    assert linear.stackable(x, layers)
    hooked = _layers(False)
    hooked[1].register_forward_hook(lambda *a: None)
    wider = [*_layers(False)[:2], nn.Linear(12, 4)]

    class MyLinear(nn.Linear):
        pass

    subclass = [*_layers(False)[:2], MyLinear(16, 4)]
    mixed_bias = [*_layers(False)[:2], nn.Linear(16, 4, bias=True)]
    for case in (hooked, wider, subclass, mixed_bias, layers[:1]):
        assert not linear.stackable(x, case)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert not linear.stackable(x, layers)
    finally:
        handle.remove()


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])  # qwen2: q/k/v biases
def test_a_model_on_npu_stacks_qkv_and_gate_up_with_hf_results(model_type):
    model = tiny_model(model_type)
    batch = {**padded_batch(), "use_cache": False}
    want_loss, want_grads = loss_and_grads(model, batch)  # plain HF (sdpa)
    keys = set(model.state_dict())
    mindspeed_hf.apply_to_model(model, mindspeed_hf.MindSpeedConfig(backend="npu"))
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    assert_close_grads(want_grads, grads)
    report = mindspeed_hf.report(model)
    assert report["ran"]["stacked_linear"] == 2 * model.config.num_hidden_layers  # q/k/v and gate/up, every layer
    assert report["implementations"]["stacked_linear"] == "npu:one_matmul"
    assert set(model.state_dict()) == keys
    assert not any("forward" in vars(m) for m in model.modules() if isinstance(m, nn.Linear))


def test_frozen_projections_stack_with_the_inputs_gradient_only():
    registry.set_backend("npu")
    try:
        layers = _layers(True)
        for layer in layers:
            layer.requires_grad_(False)
        x = torch.randn(2, 5, 16, requires_grad=True)
        (sum(o.sum() for o in linear.project(x, layers))).backward()
        got = x.grad.clone()
        x.grad = None
        (sum(layer(x).sum() for layer in layers)).backward()
        torch.testing.assert_close(got, x.grad, atol=1e-6, rtol=1e-6)
        assert all(p.grad is None for layer in layers for p in layer.parameters())
    finally:
        registry.set_backend(None)
