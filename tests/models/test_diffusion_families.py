"""diffusers denoisers (Flux, Flux.2, SD3, SDXL's UNet, Wan 2.x text- and image-to-video, Qwen-Image,
HunyuanVideo): one training step's loss (flow matching with SD3's loss weighting; epsilon for SDXL) and every
gradient equal plain diffusers (fp32: 1e-5 loss, 1e-4 relative gradients) on the torch and npu backends; on the
npu path exactly one npu_fusion_attention call per attention layer (two in Wan's image-to-video cross-attention:
text and image), npu_rotary_mul on q and k wherever the model has rope, npu_rms_norm for every q/k RMSNorm, and
report() counting the same executions."""

import pytest
import torch
from tiny_denoisers import FAMILIES, assert_close_grads, loss_and_grads, noisy_batch

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.device import import_torch_npu
from mindspeed_hf.ops import dit_attention
from mindspeed_hf.patches.diffusion import DENOISERS

NPU_OPS = {"attention": "npu_fusion_attention", "rope": "npu_rotary_mul", "rms_norm": "npu_rms_norm",
           "swiglu": "npu_swiglu"}


def npu_calls(monkeypatch) -> dict[str, int]:
    """Count the stand-in torch_npu's calls (fused kernels launched), per report() op name."""
    npu, calls = import_torch_npu(), dict.fromkeys(NPU_OPS, 0)
    for op, name in NPU_OPS.items():
        monkeypatch.setattr(npu, name, _counting(getattr(npu, name), op, calls))
    return calls


def _counting(real, op: str, calls: dict[str, int]):
    def counting(*args, **kwargs):
        calls[op] += 1
        return real(*args, **kwargs)

    return counting


def attention_layers(model) -> int:
    """Attention calls of one forward, read from the model: one per attention module, and one more where Wan's
    image-to-video cross-attention attends the image tokens too (add_k_proj)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    modules = [m for m in model.modules() if isinstance(m, (Attention, AttentionModuleMixin))]
    return len(modules) + sum(getattr(m, "add_k_proj", None) is not None and type(m).__name__ == "WanAttention"
                              for m in modules)


def test_every_family_has_a_tiny_model():
    assert set(DENOISERS) <= {name.removesuffix("_i2v") for name in FAMILIES}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_denoiser_parity(name, backend, monkeypatch):
    tiny = FAMILIES[name]()
    batch = noisy_batch(tiny)
    expected = loss_and_grads(tiny, batch)

    mindspeed_hf.enable(config_from_dict({"backend": backend}))
    settled = mindspeed_hf.apply_to_model(tiny.model)
    assert settled["backend"] == backend
    calls = npu_calls(monkeypatch)
    loss, grads = loss_and_grads(tiny, batch)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)

    report = mindspeed_hf.report(tiny.model)
    ran = {op: report["ran"][op] for op in NPU_OPS}
    want = {op: tiny.expect.get(op, 0) for op in NPU_OPS}
    assert ran == want
    assert want["attention"] == attention_layers(tiny.model)
    assert report["kernels"]["rms_norm"] == want["rms_norm"]
    if backend == "npu":
        assert calls == want  # one fused launch per attention layer, per rope'd q / k, per norm
        assert report["implementations"]["attention"] == "npu:npu_fusion_attention"
    else:
        assert calls == dict.fromkeys(NPU_OPS, 0)
        assert report["implementations"]["attention"] == "torch:sdpa"


@pytest.mark.parametrize("name", ["qwenimage", "hunyuan_video"])
def test_text_mask_over_kept_keys(name, monkeypatch):
    """A text mask too large to materialise as [B, 1, S, S] (a video's tokens): the queries attend their row's kept
    keys in TND layout (forced here by a zero threshold), still one call per layer, the same results."""
    tiny = FAMILIES[name]()
    batch = noisy_batch(tiny)
    expected = loss_and_grads(tiny, batch)
    monkeypatch.setattr(dit_attention, "DENSE_MASK_ELEMENTS", 0)
    npu = import_torch_npu()
    layouts = []

    def recording(*args, _real=npu.npu_fusion_attention, **kwargs):
        layouts.append(args[4])
        return _real(*args, **kwargs)

    monkeypatch.setattr(npu, "npu_fusion_attention", recording)
    mindspeed_hf.enable(config_from_dict({"backend": "npu"}))
    mindspeed_hf.apply_to_model(tiny.model)
    loss, grads = loss_and_grads(tiny, batch)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)
    # Qwen-Image: both joint layers; HunyuanVideo: its two video blocks (the refiner's 4-D text mask stays dense)
    assert layouts == (["TND", "TND"] if name == "qwenimage" else ["BSND", "TND", "TND"])
