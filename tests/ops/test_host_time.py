"""Host time on the hot path, without timing anything: the registry chooses a kernel once per (op, requested
backend, device type), not per call, and report() still counts every execution."""

import inspect

import pytest
import torch

from mindspeed_hf.ops import registry, rms_norm
from mindspeed_hf.patches.forwards import _binder


def test_kernel_is_chosen_once_per_op_backend_and_device(monkeypatch):
    chosen = []
    real = registry._choose

    def counting(*key):
        chosen.append(key)
        return real(*key)

    monkeypatch.setattr(registry, "_choose", counting)
    monkeypatch.setattr(registry, "_CHOSEN", {})
    registry.set_backend("torch")
    try:
        x, w = torch.randn(2, 8), torch.ones(8)
        counts: dict[str, int] = {}
        token = registry.count_into(counts)
        try:
            for _ in range(5):
                rms_norm(x, w, 1e-6)
        finally:
            registry.stop_counting(token)
        assert chosen == [("rms_norm", "torch", "cpu")]
        assert counts == {"rms_norm": 5}  # what ran: every call counted
        registry.set_backend("npu")  # another requested backend: chosen anew, once
        assert registry.implementation("rms_norm", x.device) == "npu:npu_rms_norm"
        assert registry.implementation("rms_norm", x.device) == "npu:npu_rms_norm"
        assert chosen[1:] == [("rms_norm", "npu", "cpu")]
    finally:
        registry.set_backend(None)


def _layer_forward(self, hidden_states, attention_mask=None, position_ids=None, use_cache=False, **kwargs):
    return hidden_states


@pytest.mark.parametrize("args,kwargs", [
    (("h",), {}),
    (("h",), {"position_ids": 3, "extra": 1}),
    ((), {"hidden_states": "h", "attention_mask": 2, "use_cache": True}),
    (("h", 2, 3, True), {"more": 4}),
])
def test_fused_layer_binds_as_python_does(args, kwargs):
    """The fused decoder layer's argument binding, worked out once at patch time, equals signature.bind's."""
    signature = inspect.signature(_layer_forward)
    bound = signature.bind("self", *args, **kwargs)
    bound.apply_defaults()
    expected = dict(bound.arguments)
    named, extra = _binder(signature)("self", args, kwargs)
    assert extra == expected.pop("kwargs")
    assert named == expected


@pytest.mark.parametrize("args,kwargs", [((), {}), (("h",), {"hidden_states": "h"}), (("h", 1, 2, 3, 4), {})])
def test_fused_layer_binding_raises_pythons_errors(args, kwargs):
    with pytest.raises(TypeError):
        _binder(inspect.signature(_layer_forward))("self", args, kwargs)
