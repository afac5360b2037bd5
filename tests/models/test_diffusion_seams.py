"""The diffusers internals patches/diffusion and parallel/context/denoiser.py rely on, checked on the installed
release (written against diffusers 0.42.1): the dispatcher's registry and backend names, the processors' per-call
attributes, every family's module-level sites, the _cp_plan entries' fields; and the Wan processor guard (a call
that is not the one checked keeps diffusers' rope, attention still fused)."""

import importlib
import inspect

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import mindspeed_hf  # noqa: E402
from mindspeed_hf.config import config_from_dict  # noqa: E402
from mindspeed_hf.patches.diffusion import DENOISERS, wan  # noqa: E402


def test_dispatcher_names():
    from diffusers.models import attention_dispatch as dispatch

    assert dispatch._AttentionBackendRegistry._active_backend in dispatch.AttentionBackendName
    assert dispatch.AttentionBackendName.NATIVE.value == "native"
    params = inspect.signature(dispatch.dispatch_attention_fn).parameters
    assert list(params)[:9] == ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa",
                                "attention_kwargs"]
    assert {"backend", "parallel_config"} <= set(params)


@pytest.mark.parametrize("name", list(DENOISERS))
def test_family_sites_exist(name):
    family = DENOISERS[name]
    module = importlib.import_module(family.module)
    for cls in (*family.models, *family.dispatch_processors, *family.rope_processor_calls, *family.swiglu,
                *family.local_rope):
        assert hasattr(module, cls), f"{family.module}.{cls}"
    if family.dispatch_processors:
        assert hasattr(module, "dispatch_attention_fn")
        for cls in family.dispatch_processors:
            assert {"_attention_backend", "_parallel_config"} <= set(dir(getattr(module, cls)))
    if family.rope:
        assert callable(getattr(module, family.rope))


def test_cp_plan_fields():
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    assert {"split_dim", "expected_dims", "split_output"} <= set(ContextParallelInput.__dataclass_fields__)
    assert {"gather_dim", "expected_dims"} <= set(ContextParallelOutput.__dataclass_fields__)
    for model in (diffusers.FluxTransformer2DModel, diffusers.WanTransformer3DModel):
        assert model._cp_plan


def test_wan_call_is_the_checked_one_or_rope_stays_diffusers(monkeypatch):
    from diffusers.models.transformers import transformer_wan
    from tiny_denoisers import FAMILIES, loss_and_grads, noisy_batch

    assert wan.digest(transformer_wan.WanAttnProcessor.__call__) in wan.KNOWN_CALLS  # 0.42's call
    monkeypatch.setattr(wan, "KNOWN_CALLS", frozenset())
    original = vars(transformer_wan.WanAttnProcessor)["__call__"]
    tiny = FAMILIES["wan"]()
    batch = noisy_batch(tiny)
    expected = loss_and_grads(tiny, batch)
    mindspeed_hf.enable(config_from_dict({"backend": "npu"}))
    assert vars(transformer_wan.WanAttnProcessor)["__call__"] is original
    report = mindspeed_hf.apply_to_model(tiny.model)
    assert report["kernels"]["rope"] == 0 and report["kernels"]["attention"] == 4
    loss, _ = loss_and_grads(tiny, batch)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert mindspeed_hf.report(tiny.model)["ran"] == {"rms_norm": 8, "rope": 0, "swiglu": 0, "attention": 4}
