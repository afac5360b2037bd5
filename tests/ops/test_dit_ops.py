"""The denoiser ops against diffusers' own code: attention (BSND / BNSD, key-padding masks dense and over the kept
keys in TND, 4-D bool masks, float masks on the torch path), rope (interleaved and half tables vs diffusers'
apply_rotary_emb, Qwen-Image's complex frequencies, Wan's 3-D table), the RMSNorm modules' dtype rules; forward and
backward, torch and npu backends."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("diffusers")
from diffusers.models.embeddings import apply_rotary_emb  # noqa: E402
from diffusers.models.normalization import RMSNorm  # noqa: E402
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen  # noqa: E402

from mindspeed_hf.device import import_torch_npu  # noqa: E402
from mindspeed_hf.ops import dit_attention as attention_op  # noqa: E402
from mindspeed_hf.ops.dit_attention import dit_attention  # noqa: E402
from mindspeed_hf.ops.dit_rms_norm import dit_rms_norm  # noqa: E402
from mindspeed_hf.ops.dit_rope import complex_tables, dit_rope  # noqa: E402


def _qkv(b=2, sq=6, skv=7, n=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, generator=gen, requires_grad=True) for s in (sq, skv, skv)]


def _sdpa_bsnd(q, k, v, mask=None):
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask)
    return out.transpose(1, 2)


def _grads(fn, tensors):
    out = fn(*tensors)
    out.backward(torch.ones_like(out) * torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out.detach(), grads


def _assert_same(fn_ours, fn_ref, tensors):
    (out, grads), (want, want_grads) = _grads(fn_ours, tensors), _grads(fn_ref, tensors)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask_kind", ["none", "key_padding", "key_padding_tnd", "bool_4d"])
def test_attention_bsnd(backend, mask_kind, monkeypatch):
    q, k, v = _qkv()
    mask = None
    if mask_kind.startswith("key_padding"):
        mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
        mask[0, ..., 2:4] = False  # a hole in the middle (Qwen-Image: text padding before the image tokens)
        mask[1, ..., 6:] = False
    elif mask_kind == "bool_4d":
        mask = torch.rand(2, 1, 6, 7, generator=torch.Generator().manual_seed(3)) > 0.3
        mask[..., 0] = True  # no fully masked row
    if mask_kind == "key_padding_tnd":
        monkeypatch.setattr(attention_op, "DENSE_MASK_ELEMENTS", 0)
    npu, layouts = import_torch_npu(), []

    def recording(*args, _real=npu.npu_fusion_attention, **kwargs):
        layouts.append(args[4])
        return _real(*args, **kwargs)

    monkeypatch.setattr(npu, "npu_fusion_attention", recording)
    _assert_same(lambda *t: dit_attention(*t, "BSND", mask), lambda *t: _sdpa_bsnd(*t, mask), [q, k, v])
    if backend == "npu":  # one call (the op's own backward follows it)
        assert layouts == ["TND" if mask_kind == "key_padding_tnd" else "BSND"]
    else:
        assert layouts == []


def test_attention_bnsd_views_and_scale(backend):
    """attention_processor.py's q/k/v: BNSD views of BSND memory (run as BSND without a copy on npu), a scale."""
    q, k, v = _qkv(sq=7)
    views = [t.transpose(1, 2) for t in (q, k, v)]

    def ours(*t):
        return dit_attention(*(x.transpose(1, 2) for x in t), "BNSD", None, 0.0, 0.3)

    def ref(*t):
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in t), scale=0.3)

    assert views[0].transpose(1, 2).is_contiguous()
    _assert_same(ours, ref, [q, k, v])


def test_float_mask_runs_the_torch_path(monkeypatch, caplog):
    """An additive mask cannot be the op's bool mask: the npu backend runs SDPA there (one warning)."""
    from mindspeed_hf.ops import registry

    registry.set_backend("npu")
    q, k, v = _qkv()
    mask = torch.zeros(2, 1, 6, 7)
    mask[..., 3] = float("-inf")
    npu = import_torch_npu()
    monkeypatch.setattr(npu, "npu_fusion_attention", lambda *a, **k: pytest.fail("fused call with a float mask"))
    _assert_same(lambda *t: dit_attention(*t, "BSND", mask), lambda *t: _sdpa_bsnd(*t, mask), [q, k, v])
    assert "additive" in caplog.text


@pytest.mark.parametrize("unbind", [-1, -2])
@pytest.mark.parametrize("sequence_dim", [1, 2])
def test_rope_tables(backend, unbind, sequence_dim):
    gen = torch.Generator().manual_seed(0)
    shape = (2, 5, 3, 8) if sequence_dim == 1 else (2, 3, 5, 8)
    x = torch.randn(shape, generator=gen, requires_grad=True)
    cos, sin = torch.randn(5, 8, generator=gen), torch.randn(5, 8, generator=gen)
    table = (1, 5, 1, 8) if sequence_dim == 1 else (1, 1, 5, 8)
    mode = "interleave" if unbind == -1 else "half"
    _assert_same(lambda t: dit_rope(t, cos.view(table), sin.view(table), mode),
                 lambda t: apply_rotary_emb(t, (cos, sin), use_real_unbind_dim=unbind, sequence_dim=sequence_dim), [x])


def test_rope_complex_frequencies(backend):
    """Qwen-Image: x times complex frequencies = the interleaved rotation by their real / imaginary parts."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, generator=gen, requires_grad=True)
    freqs = torch.polar(torch.ones(5, 4), torch.randn(5, 4, generator=gen))
    cos, sin = complex_tables(freqs)
    _assert_same(lambda t: dit_rope(t, cos.view(1, 5, 1, 8), sin.view(1, 5, 1, 8)),
                 lambda t: apply_rotary_emb_qwen(t, freqs, use_real=False), [x])


def test_rope_bf16_in_fp32(backend):
    """diffusers computes the rotation in fp32 and casts once: so do both backends."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, generator=gen).bfloat16()
    cos, sin = torch.randn(5, 8, generator=gen), torch.randn(5, 8, generator=gen)
    ours = dit_rope(x, cos.view(1, 5, 1, 8), sin.view(1, 5, 1, 8))
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours, apply_rotary_emb(x, (cos, sin), sequence_dim=1), atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["torch", "diffusers", "diffusers_bias"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.float32, torch.bfloat16)])
def test_rms_norm_modules(backend, kind, dtypes):
    x_dtype, w_dtype = dtypes
    module = torch.nn.RMSNorm(8, eps=1e-6) if kind == "torch" else RMSNorm(8, eps=1e-6, bias=kind.endswith("bias"))
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
        if getattr(module, "bias", None) is not None:
            module.bias.uniform_(-1, 1)
    module.to(w_dtype)
    x = torch.randn(2, 5, 8).to(x_dtype)
    original = type(module).forward
    ours, want = dit_rms_norm(module, x, original), original(module, x)
    assert ours.dtype == want.dtype
    exact = x_dtype == w_dtype == torch.float32
    torch.testing.assert_close(ours, want, atol=1e-6 if exact else 2e-2, rtol=1e-6 if exact else 2e-2)
