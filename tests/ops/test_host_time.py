"""Host time on the hot path, without timing anything: the registry chooses a kernel once per (op, requested
backend, device type), not per call, and report() still counts every execution."""

import torch

from mindspeed_hf.ops import registry, rms_norm


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
