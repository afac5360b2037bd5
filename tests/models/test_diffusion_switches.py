"""What turns a denoiser's kernels on and off: built while enabled it is accelerated without a call; disable() puts
back every diffusers / torch symbol and the model runs plain diffusers again; an attention backend the user chose
(`set_attention_backend`, `attention_backend(...)`) is kept; a kernel switched off in the config runs diffusers' code;
an unsupported denoiser runs unaccelerated with one warning; nothing outside an accelerated denoiser (a VAE's
attention) is touched."""

import sys

import pytest
import torch
from tiny_denoisers import FAMILIES, assert_close_grads, loss_and_grads, noisy_batch

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.device import import_torch_npu

diffusers = pytest.importorskip("diffusers")
from diffusers.models import attention_dispatch, attention_processor, normalization  # noqa: E402
from diffusers.models.transformers import transformer_flux, transformer_qwenimage, transformer_wan  # noqa: E402


def _fused_calls(monkeypatch) -> list[str]:
    npu, calls = import_torch_npu(), []
    for name in ("npu_fusion_attention", "npu_rotary_mul", "npu_rms_norm"):
        def counting(*args, _real=getattr(npu, name), _name=name, **kwargs):  # noqa: B008
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(npu, name, counting)
    return calls


def _symbols():
    return {"flux dispatch": transformer_flux.dispatch_attention_fn, "flux rope": transformer_flux.apply_rotary_emb,
            "qwen rope": transformer_qwenimage.apply_rotary_emb_qwen,
            "wan call": vars(transformer_wan.WanAttnProcessor)["__call__"],
            "flux init": vars(transformer_flux.FluxTransformer2DModel)["__init__"],
            "nn.RMSNorm": vars(torch.nn.RMSNorm)["forward"], "RMSNorm": vars(normalization.RMSNorm)["forward"],
            "F": attention_processor.F}


def test_built_while_enabled_then_disabled(monkeypatch):
    before = _symbols()
    tiny = FAMILIES["flux"]()
    batch = noisy_batch(tiny)
    expected = loss_and_grads(tiny, batch)
    mindspeed_hf.enable(config_from_dict({"backend": "npu"}))
    assert all(before[k] is not v for k, v in _symbols().items())
    built = FAMILIES["flux"]()  # the same weights (seeded), built while enabled: accelerated with no call
    calls = _fused_calls(monkeypatch)
    loss, grads = loss_and_grads(built, batch)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)
    assert calls.count("npu_fusion_attention") == 3
    assert mindspeed_hf.report(built.model)["ran"]["attention"] == 3

    mindspeed_hf.disable()
    mindspeed_hf.disable()  # idempotent
    assert _symbols() == before  # every patched symbol is the very object it was
    calls.clear()
    loss, grads = loss_and_grads(built, batch)
    assert calls == []  # plain diffusers again
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert not any(getattr(h, "_mindspeed_scope", False) for m in built.model.modules()
                   for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values()))
    assert mindspeed_hf.report(built.model)["kernels"] == dict.fromkeys(("rms_norm", "rope", "swiglu", "attention"), 0)


def test_explicit_attention_backend_is_kept(monkeypatch):
    tiny = FAMILIES["wan"]()
    mindspeed_hf.enable(config_from_dict({"backend": "npu"}))
    mindspeed_hf.apply_to_model(tiny.model)
    tiny.model.set_attention_backend("native")  # the user's choice, after ours
    calls = _fused_calls(monkeypatch)
    loss_and_grads(tiny, noisy_batch(tiny))
    assert "npu_fusion_attention" not in calls and calls.count("npu_rotary_mul") == 4  # rope, norms still fused
    report = mindspeed_hf.report(tiny.model)
    assert report["kernels"]["attention"] == 0 and report["kept"]["attention"] == "native (requested explicitly)"


def test_process_wide_backend_is_kept(monkeypatch):
    tiny = FAMILIES["flux"]()
    mindspeed_hf.enable(config_from_dict({"backend": "npu"}))
    mindspeed_hf.apply_to_model(tiny.model)
    calls = _fused_calls(monkeypatch)
    with attention_dispatch.attention_backend("_native_math"):
        loss_and_grads(tiny, noisy_batch(tiny))
        assert mindspeed_hf.report(tiny.model)["kept"]["attention"] == "_native_math (chosen for the process)"
    assert "npu_fusion_attention" not in calls
    calls.clear()
    loss_and_grads(tiny, noisy_batch(tiny))
    assert calls.count("npu_fusion_attention") == 3


def test_kernel_switched_off_in_the_config(monkeypatch):
    tiny = FAMILIES["qwenimage"]()
    batch = noisy_batch(tiny)
    expected = loss_and_grads(tiny, batch)
    mindspeed_hf.enable(config_from_dict({"backend": "npu", "kernels": {"rope": False}}))
    report = mindspeed_hf.apply_to_model(tiny.model)
    assert report["kernels"]["rope"] == 0 and report["kernels"]["attention"] == 2
    calls = _fused_calls(monkeypatch)
    loss, grads = loss_and_grads(tiny, batch)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert "npu_rotary_mul" not in calls and calls.count("npu_fusion_attention") == 2


def test_unsupported_denoiser_and_vae_stay_plain(monkeypatch, caplog):
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=2,
                                  down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",))
    mindspeed_hf.enable(config_from_dict({"backend": "npu"}))
    calls = _fused_calls(monkeypatch)
    for _ in range(2):
        report = mindspeed_hf.apply_to_model(vae)
    assert sum("AutoencoderKL is not supported" in r.message for r in caplog.records) == 1
    assert report["kernels"] == dict.fromkeys(("rms_norm", "rope", "swiglu", "attention"), 0)
    vae(torch.randn(1, 3, 8, 8))  # its mid-block attention is attention_processor's AttnProcessor2_0
    assert calls == []


def test_families_are_patched_when_imported(monkeypatch):
    """enable() imports no diffusers module: it watches each family's module and patches it once imported."""
    from mindspeed_hf.patches import third_party
    from mindspeed_hf.patches.diffusion import families, model

    late = families.DenoiserFamily("late", "late_denoiser_module", ("LateModel",), blocks=(), attention=())
    monkeypatch.setitem(families.DENOISERS, "late", late)
    seen = []
    monkeypatch.setattr(model, "patch_family", lambda family, module: seen.append((family.name, module.__name__)))
    mindspeed_hf.enable(config_from_dict({"backend": "torch"}))
    assert "late_denoiser_module" not in sys.modules and "late_denoiser_module" in third_party._finder.watched
    assert ("flux", transformer_flux.__name__) in seen  # already imported: patched at once
    seen.clear()
    with pytest.raises(ModuleNotFoundError):  # the watch finds nothing itself
        __import__("late_denoiser_module")
    assert seen == []
