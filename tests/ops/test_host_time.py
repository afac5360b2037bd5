"""Host time on the hot path, without timing anything: the registry chooses a kernel once per (op, requested
backend, device), not per call, and report() still counts every execution."""

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
        assert chosen == [("rms_norm", "torch", torch.device("cpu"))]
        assert counts == {"rms_norm": 5}  # what ran: every call counted
        registry.set_backend("npu")  # another requested backend: chosen anew, once
        assert registry.implementation("rms_norm", x.device) == "npu:npu_rms_norm"
        assert registry.implementation("rms_norm", x.device) == "npu:npu_rms_norm"
        assert chosen[1:] == [("rms_norm", "npu", torch.device("cpu"))]
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


LAZY_FAMILY = """
import sys
import mindspeed_hf
assert 'transformers.models.qwen3.modeling_qwen3' not in sys.modules, 'import mindspeed_hf imported qwen3'
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3 import modeling_qwen3
from mindspeed_hf.patches.engine import PATCHES
assert PATCHES.is_patched(modeling_qwen3.Qwen3RMSNorm, 'forward'), 'qwen3 not patched at its import'
import importlib
experts = importlib.import_module('mindspeed_hf.ops.experts')
assert not experts._traced, 'the compiled experts op was registered without an MoE family'
torch.manual_seed(0)
config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)
model = Qwen3ForCausalLM(config)
ids = torch.randint(0, 64, (1, 8))
ours = model(input_ids=ids, labels=ids).loss
ran = mindspeed_hf.report(model)['ran']
mindspeed_hf.disable()
plain = model(input_ids=ids, labels=ids).loss
assert abs(ours.item() - plain.item()) < 1e-5, (ours.item(), plain.item())
assert ran['rms_norm'] > 0 and ran['attention'] > 0, ran
mindspeed_hf.enable()
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: F401
fused = hasattr(modeling_qwen3_moe, 'Qwen3MoeExperts')  # transformers >= 5; 4.57 holds one module per expert
assert bool(experts._traced) == fused, ('compiled experts op registered', bool(experts._traced), 'fused', fused)
assert not fused or hasattr(torch.ops.mindspeed_hf, 'grouped_matmul'), 'an MoE family patched without its op'
print('ok')
"""


def test_family_is_patched_when_its_modeling_module_is_imported():
    """`import mindspeed_hf` imports no family's modeling module and registers no compiled experts op (import
    time); the module the user imports later is patched right after its import, and its model's loss equals the
    plain one; an MoE family's patch registers the op its compiled graphs run."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MINDSPEED_HF_AUTO": "1", "MINDSPEED_HF_BACKEND": "torch",
           "MINDSPEED_HF_KERNELS_TORCH_PATH": "fused"}  # ours everywhere: the script counts every kernel
    done = subprocess.run([sys.executable, "-c", LAZY_FAMILY], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
