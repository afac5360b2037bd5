"""The torch backend's fp32 RMSNorm (torch's own rms_norm, one dispatched op) gives HF's bits exactly, forward and
backward, not merely within the parity tolerance: Llama's form and Gemma's offset form."""

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from mindspeed_hf.ops import rms_norm
from mindspeed_hf.ops.registry import set_backend


@pytest.fixture(autouse=True)
def _torch_backend():
    set_backend("torch")
    yield
    set_backend(None)


@pytest.mark.parametrize("shape,eps", [((1, 8, 128), 1e-6), ((3, 7, 40), 1e-5), ((2, 5, 3, 24), 1e-6),
                                       ((4, 33, 4096), 1e-6)])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("hf_cls", [Qwen3RMSNorm, GemmaRMSNorm])
def test_fp32_rms_norm_is_bitwise_hf(shape, eps, transposed, hf_cls, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    hf = hf_cls(shape[-1], eps=eps)
    offset = hf_cls is GemmaRMSNorm
    with torch.no_grad():
        hf.weight.copy_(torch.randn(shape[-1], generator=gen))
    base = torch.randn(*shape, generator=gen) * 3
    if transposed:  # a non-contiguous input (q / k after their transpose)
        base = base.transpose(0, 1).contiguous().transpose(0, 1)
    x_hf, x_ours = base.clone().requires_grad_(), base.clone().requires_grad_()
    w_ours = hf.weight.detach().clone().requires_grad_()
    fused, real = [], torch.rms_norm
    monkeypatch.setattr(torch, "rms_norm", lambda *a, **k: fused.append(1) or real(*a, **k))
    out_hf, out_ours = hf(x_hf), rms_norm(x_ours, w_ours, eps, offset=offset)
    assert fused == [1]  # torch's one op ran
    assert torch.equal(out_hf, out_ours)
    upstream = torch.randn(out_hf.shape, generator=gen)
    grads_hf = torch.autograd.grad(out_hf, (x_hf, hf.weight), upstream)
    grads_ours = torch.autograd.grad(out_ours, (x_ours, w_ours), upstream)
    for a, b in zip(grads_hf, grads_ours, strict=True):
        assert torch.equal(a, b)
