"""memory.offload_activations on every family: fp32 loss and every gradient bitwise equal to the same model without
it (alone, and with selective or full recompute, whose recompute inputs are then what is offloaded); the device
storage is really freed once the next layer starts and restored in backward, in the right order, one layer ahead;
nothing is left after backward; the host buffers are reused on the second step; a forward that raises leaves no
state; LoRA and gradient accumulation."""

from __future__ import annotations

import pytest
import torch
from test_selective_recompute import _assert_bitwise, _loss_and_grads, _prepared
from tiny_models import FAMILY_CONFIGS, padded_batch, tiny_model

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.memory import is_offload_layer, offloader_of, remove_offload
from mindspeed_hf.memory.offload import ActivationOffloader, offloadable
from mindspeed_hf.memory.recompute import decoder_layers
from mindspeed_hf.parallel.parallelize import parallelize

OFFLOAD = {"offload_activations": True, "offload_min_bytes": 0}
MODES = {"offload": OFFLOAD, "offload+selective": {**OFFLOAD, "recompute": "selective"},
         "offload+full": {**OFFLOAD, "recompute": "full"}}


def _checked_step(model, batch, frees: bool = True):
    """One step; the offloader copied (and, with `frees`, really freed) device memory and left nothing behind.

    (With full recompute, the only offloaded layer of a 2-layer model saves just its input, the embedding output,
    which the model still holds: copied, then kept. The 4-layer tests below see full recompute's inputs freed.)"""
    offloader = offloader_of(model)
    offloader.trace = []
    result = _loss_and_grads(model, batch)
    assert ("pack", 0) in offloader.trace
    assert offloader.peak_offloaded_bytes > 0 or not frees
    assert offloader.live_entries() == 0 and offloader.offloaded_bytes == 0
    return result


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_offload_is_bitwise_equal(model_type):
    """Each mode against the model without offload or recompute (recompute alone is bitwise equal to that:
    test_selective_recompute.py)."""
    batch = padded_batch()
    expected = _loss_and_grads(_prepared(model_type, None), batch)
    for mode, memory in MODES.items():
        _assert_bitwise(expected, _checked_step(_prepared(model_type, memory), batch, frees=mode != "offload+full"))


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "gemma2"])
def test_offload_with_lora(model_type):
    batch = padded_batch()
    expected = _loss_and_grads(_prepared(model_type, None, lora=True), batch)
    for mode in ("offload", "offload+full"):
        model = _prepared(model_type, MODES[mode], lora=True)
        _assert_bitwise(expected, _checked_step(model, batch, frees=mode != "offload+full"))


def test_npu_backend(backend):
    batch = padded_batch()
    expected = _loss_and_grads(_prepared("qwen3", None, backend=backend), batch)
    _assert_bitwise(expected, _checked_step(_prepared("qwen3", OFFLOAD, backend=backend), batch))


# ------------------------------------------------------------------------------------------- the mechanism
def _four_layers(memory: dict | None):
    model = tiny_model("qwen3", num_hidden_layers=4).train()
    config = config_from_dict({"memory": memory or {}})
    mindspeed_hf.enable()
    mindspeed_hf.apply_to_model(model, config)
    return parallelize(model, None, config)


def _runs(trace):
    """The trace with repeats collapsed and keep events left out: [("pack", 0), ("free", 0), ...]."""
    out = []
    for event in trace:
        if event[0] != "keep" and (not out or out[-1] != event):
            out.append(event)
    return out


@pytest.mark.parametrize("recompute", [False, "full"])
def test_pack_free_prefetch_order(recompute):
    model = _four_layers({**OFFLOAD, "recompute": recompute})
    offloader = offloader_of(model)
    offloader.trace = []
    _loss_and_grads(model, padded_batch())
    assert _runs(offloader.trace) == [
        ("pack", 0), ("free", 0), ("pack", 1), ("free", 1), ("pack", 2), ("free", 2),  # layer 3 (the last) kept
        ("load", 2), ("load", 1), ("unpack", 2), ("load", 0), ("unpack", 1), ("unpack", 0)]  # one layer ahead


def test_storage_freed_after_next_layer_starts_and_restored_in_backward():
    model = _four_layers(OFFLOAD)
    offloader = offloader_of(model)
    layers = decoder_layers(model)
    seen: dict[str, list] = {"packed": [], "in_layer1": [], "unpacked": []}
    pack = offloader._pack

    def spy_pack(record, t):
        packed = pack(record, t)
        if record.layer == 0 and not isinstance(packed, torch.Tensor):
            seen["packed"].append((packed.alias, packed.alias.untyped_storage().nbytes()))
        return packed

    def in_layer1(module, args):
        seen["in_layer1"] = [alias.untyped_storage().nbytes() for alias, _ in seen["packed"]]

    unpack = offloader._unpack

    def spy_unpack(packed):
        tensor = unpack(packed)
        if not isinstance(packed, torch.Tensor):
            seen["unpacked"].append(tensor.untyped_storage().nbytes() == packed.entry.nbytes)
        return tensor

    offloader._pack, offloader._unpack = spy_pack, spy_unpack
    handle = layers[1].self_attn.register_forward_pre_hook(in_layer1)
    expected = _loss_and_grads(_four_layers(None), padded_batch())
    loss = model(**padded_batch()).loss
    sizes = [n for _, n in seen["packed"]]
    assert sizes and all(n > 0 for n in sizes)
    assert seen["in_layer1"] and any(n == 0 for n in seen["in_layer1"])  # freed once layer 1 started
    freed = sum(n for n, now in zip(sizes, seen["in_layer1"]) if now == 0)
    assert 0 < freed <= offloader.peak_offloaded_bytes
    loss.backward()
    handle.remove()
    assert seen["unpacked"] and all(seen["unpacked"])  # restored before autograd reads them
    assert all(alias.untyped_storage().nbytes() == n for (alias, n) in seen["packed"])
    assert offloader.live_entries() == 0 and offloader.offloaded_bytes == 0
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    _assert_bitwise(expected, (loss.detach(), grads))


def test_host_buffers_reused_on_the_second_step():
    model = _four_layers(OFFLOAD)
    offloader = offloader_of(model)
    batch = padded_batch()
    _loss_and_grads(model, batch)
    (pool,) = offloader.pools.values()
    allocated, reused = pool.allocated, pool.reused
    buffers = {b.data_ptr() for free in pool._free.values() for b in free}
    assert allocated > 0 and pool.free_buffers() == allocated  # every buffer back in the pool after backward
    _loss_and_grads(model, batch)
    assert pool.allocated == allocated and pool.reused - reused >= allocated
    assert {b.data_ptr() for free in pool._free.values() for b in free} == buffers


def test_forward_that_raises_leaves_no_state(monkeypatch):
    model = _four_layers(OFFLOAD)
    offloader = offloader_of(model)
    batch = padded_batch()
    mlp = decoder_layers(model)[2].mlp

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(mlp, "forward", boom)
    with pytest.raises(RuntimeError, match="boom"):
        model(**batch)
    assert offloader.live_entries() == 0 and offloader.offloaded_bytes == 0
    (pool,) = offloader.pools.values()
    assert pool.free_buffers() == pool.allocated
    monkeypatch.undo()
    _assert_bitwise(_loss_and_grads(_four_layers(None), batch), _checked_step(model, batch))


def test_gradient_accumulation_and_outstanding_forwards():
    """Two micro-batches accumulated, and two forwards whose backward comes after both."""
    first, second = padded_batch(seed=1), padded_batch(seed=2)

    def accumulate(model, together: bool):
        model.zero_grad(set_to_none=True)
        if together:
            (model(**first).loss + model(**second).loss).backward()
        else:
            model(**first).loss.backward()
            model(**second).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    for together in (False, True):
        expected = accumulate(_four_layers(None), together)
        model = _four_layers(OFFLOAD)
        got = accumulate(model, together)
        assert expected.keys() == got.keys() and all(torch.equal(expected[n], got[n]) for n in expected)
        assert offloader_of(model).live_entries() == 0


def test_offload_layers_and_min_bytes():
    model = _four_layers({**OFFLOAD, "offload_layers": [1, 3]})
    offloader = offloader_of(model)
    offloader.trace = []
    _loss_and_grads(model, padded_batch())
    assert {layer for event, layer in offloader.trace if event == "pack"} == {1}  # 3 is the last: kept
    model = _four_layers({**OFFLOAD, "offload_min_bytes": 1 << 30})
    _loss_and_grads(model, padded_batch())
    assert offloader_of(model).peak_offloaded_bytes == 0
    with pytest.raises(ValueError, match=r"memory.offload_layers=\[7\]: the model has 4 decoder layers"):
        _four_layers({**OFFLOAD, "offload_layers": [7]})


def test_offload_layers_that_leave_nothing_wrap_nothing(caplog):
    model = _four_layers({**OFFLOAD, "offload_layers": [3]})  # only the last layer, which is always kept
    assert offloader_of(model) is None and not any(is_offload_layer(layer) for layer in decoder_layers(model))
    assert "leaves no decoder layer of 4 to offload" in caplog.text


def test_what_is_never_offloaded():
    weight = torch.nn.Parameter(torch.randn(64, 64))
    activation = torch.randn(64, 64) * 2
    assert offloadable(activation, 0)
    assert not offloadable(weight, 0)
    assert not offloadable(activation[:8], 0)  # a view
    assert not offloadable(activation.t(), 0)
    assert not offloadable(activation, activation.nbytes + 1)  # below the minimum size


def test_remove_offload_restores_the_layers():
    model = _four_layers(OFFLOAD)
    layers = decoder_layers(model)
    base = type(_four_layers(None).model.layers[0])
    assert all(is_offload_layer(layer) and type(layer) is not base for layer in layers)
    assert {type(layer).__name__ for layer in layers} == {base.__name__}  # found by class name as before
    remove_offload(model)
    assert all(type(layer) is base and not is_offload_layer(layer) for layer in layers)
    assert offloader_of(model) is None
    _assert_bitwise(_loss_and_grads(_four_layers(None), padded_batch()), _loss_and_grads(model, padded_batch()))


def test_one_storage_saved_with_two_shapes_comes_back_with_each():
    """`_unsafe_view` gives a second tensor (not a view) on the same storage: copied once, each unpacked with its
    own shape."""
    def layer(h):
        a = h.sin()
        b = torch.ops.aten._unsafe_view(a, (-1,))
        return a.cos(), b.sin()  # cos saves a, sin saves b: one storage, two shapes

    def run(offloader):
        h = torch.randn(8, 16, requires_grad=True, generator=torch.Generator().manual_seed(0))
        if offloader is None:
            c, d = layer(h)
        else:
            with offloader.layer(0, True):
                c, d = layer(h)
            with offloader.layer(1, False):
                pass  # the next layer starts: layer 0's storage is freed
            assert offloader.offloaded_bytes == 8 * 16 * 4
        (c.sum() + d.square().sum()).backward()
        return h.grad

    offloader = ActivationOffloader(0)
    offloader.trace = []
    assert torch.equal(run(None), run(offloader))
    # copies: h (sin's input; held by the caller, so kept) and a, once for both shapes
    assert offloader.trace.count(("pack", 0)) == 2 and offloader.trace.count(("keep", 0)) == 1
    assert offloader.live_entries() == 0
