"""The torch backend's RMSNorm (and its residual-add form) against HF's modules, Llama's form and Gemma's offset
form, fp32 and bf16. Large inputs (the lean path): HF's bits forward, gradients within fp32 rounding, and less kept
for the backward than HF's autograd keeps (the input and a per-row rstd, not the normalised copy). Small inputs:
torch's own rms_norm, HF's bits forward and backward. Each test runs both paths by moving the size threshold."""

import importlib

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from mindspeed_hf.ops import rms_norm
from mindspeed_hf.ops.registry import set_backend
from mindspeed_hf.ops.rms_norm import add_rms_norm

rms_norm_module = importlib.import_module("mindspeed_hf.ops.rms_norm")  # the package's `rms_norm` is the function


@pytest.fixture(autouse=True)
def _torch_backend():
    set_backend("torch")
    yield
    set_backend(None)


@pytest.fixture(params=["lean", "small"])
def lean(request, monkeypatch):
    """True: every input takes the lean path (threshold 0); False: none does (torch's graph, HF's bits)."""
    monkeypatch.setattr(rms_norm_module, "LEAN_FROM_ELEMENTS", 0 if request.param == "lean" else 1 << 62)
    return request.param == "lean"


def _saved_bytes(fn):
    """(result of fn(), bytes autograd keeps for its backward)."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(saved.values())


def _hf_norm(hf_cls, dim, eps, dtype, gen):
    hf = hf_cls(dim, eps=eps)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(dim, generator=gen))
    return hf.to(dtype)


@pytest.mark.parametrize("shape,eps", [((1, 8, 128), 1e-6), ((3, 7, 40), 1e-5), ((2, 5, 3, 24), 1e-6),
                                       ((4, 33, 1024), 1e-6)])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("hf_cls", [Qwen3RMSNorm, GemmaRMSNorm])
def test_rms_norm_matches_hf(shape, eps, transposed, hf_cls, lean):
    gen = torch.Generator().manual_seed(0)
    hf = _hf_norm(hf_cls, shape[-1], eps, torch.float32, gen)
    base = torch.randn(*shape, generator=gen) * 3
    if transposed:  # a non-contiguous input (q / k after their transpose)
        base = base.transpose(0, 1).contiguous().transpose(0, 1)
    x_hf, x_ours = base.clone().requires_grad_(), base.clone().requires_grad_()
    w_ours = hf.weight.detach().clone().requires_grad_()
    out_hf, kept_hf = _saved_bytes(lambda: hf(x_hf))
    out_ours, kept_ours = _saved_bytes(lambda: rms_norm(x_ours, w_ours, eps, offset=hf_cls is GemmaRMSNorm))
    assert torch.equal(out_hf, out_ours)  # HF's bits
    if lean:  # the input, the weight, the rstd
        assert kept_ours < kept_hf and kept_ours <= (base.nelement() + shape[-1] + base[..., :1].nelement()) * 4
    upstream = torch.randn(out_hf.shape, generator=gen)
    grads_hf = torch.autograd.grad(out_hf, (x_hf, hf.weight), upstream)
    grads_ours = torch.autograd.grad(out_ours, (x_ours, w_ours), upstream)
    for a, b in zip(grads_hf, grads_ours, strict=True):
        if lean:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(a, b)


@pytest.mark.parametrize("hf_cls", [Qwen3RMSNorm, GemmaRMSNorm])
def test_bf16_rms_norm_matches_hf(hf_cls, lean):
    gen = torch.Generator().manual_seed(1)
    hf = _hf_norm(hf_cls, 64, 1e-6, torch.bfloat16, gen)
    base = (torch.randn(2, 9, 64, generator=gen) * 2).to(torch.bfloat16)
    x_hf, x_ours = base.clone().requires_grad_(), base.clone().requires_grad_()
    w_ours = hf.weight.detach().clone().requires_grad_()
    out_hf, out_ours = hf(x_hf), rms_norm(x_ours, w_ours, 1e-6, offset=hf_cls is GemmaRMSNorm)
    assert out_ours.dtype == out_hf.dtype and torch.equal(out_hf, out_ours)
    upstream = torch.randn(out_hf.shape, generator=gen).to(out_hf.dtype)
    grads_hf = torch.autograd.grad(out_hf, (x_hf, hf.weight), upstream)
    grads_ours = torch.autograd.grad(out_ours, (x_ours, w_ours), upstream)
    for a, b in zip(grads_hf, grads_ours, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
def test_add_rms_norm_matches_hf(dtypes, lean):
    """residual + x, then HF's norm; both outputs' gradients flow (the sum is the next layer's residual); a bf16
    branch output added to an fp32 residual (autocast) gets its gradient in its own dtype."""
    gen = torch.Generator().manual_seed(2)
    hf = _hf_norm(Qwen3RMSNorm, 48, 1e-6, torch.float32, gen)
    res = torch.randn(3, 5, 48, generator=gen)
    x = torch.randn(3, 5, 48, generator=gen).to(dtypes[1])
    leaves_hf = [res.clone().requires_grad_(), x.clone().requires_grad_()]
    leaves_ours = [res.clone().requires_grad_(), x.clone().requires_grad_()]
    w_ours = hf.weight.detach().clone().requires_grad_()
    hidden_hf = leaves_hf[0] + leaves_hf[1]
    normed_hf = hf(hidden_hf)
    (normed_ours, hidden_ours), kept = _saved_bytes(lambda: add_rms_norm(*leaves_ours, w_ours, 1e-6))
    assert torch.equal(normed_hf, normed_ours) and torch.equal(hidden_hf, hidden_ours)
    if lean:
        assert kept <= res.nelement() * 4 + 48 * 4 + 15 * 4  # the sum, the weight, the rstd
    g_normed, g_hidden = torch.randn(normed_hf.shape, generator=gen), torch.randn(normed_hf.shape, generator=gen)
    grads_hf = torch.autograd.grad((normed_hf, hidden_hf), (*leaves_hf, hf.weight), (g_normed, g_hidden))
    grads_ours = torch.autograd.grad((normed_ours, hidden_ours), (*leaves_ours, w_ours), (g_normed, g_hidden))
    for a, b in zip(grads_hf, grads_ours, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_frozen_weight_and_inference(lean):
    """A frozen norm weight (LoRA) gets no gradient; under no_grad nothing is kept (HF's forward, no Function)."""
    x = torch.randn(2, 4, 16, requires_grad=True)
    w = torch.randn(16)
    rms_norm(x, w, 1e-6).sum().backward()
    assert x.grad is not None and w.grad is None
    with torch.no_grad():
        assert rms_norm(x, w, 1e-6).grad_fn is None
