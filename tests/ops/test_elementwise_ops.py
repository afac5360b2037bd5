"""RMSNorm, rotary embedding and SwiGLU against HF's own eager modules and functions: forward and backward,
fp32 tight and bf16 loose, odd shapes, on the torch reference and on the NPU path (stand-in torch_npu)."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama import modeling_llama
from transformers.models.phi3 import modeling_phi3
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from mindspeed_hf.ops import apply_rotary_pos_emb, implementation, rms_norm, swiglu, swiglu_packed
from mindspeed_hf.ops.rms_norm import add_rms_norm

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def _leaf(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).requires_grad_()


def _grads(out, *inputs):
    torch.manual_seed(0)
    return torch.autograd.grad(out, inputs, torch.randn_like(out))


def _check(ours, theirs, dtype):
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hf_cls,offset,shape", [
    (modeling_llama.LlamaRMSNorm, False, (3, 7, 40)),
    (Qwen3RMSNorm, False, (2, 5, 3, 24)),  # q_norm / k_norm over [B, S, N, D]
    (GemmaRMSNorm, True, (3, 7, 40)),
])
def test_rms_norm_matches_hf(hf_cls, offset, shape, dtype, backend):
    hf = hf_cls(shape[-1], eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(shape[-1]) * 0.1 + (0 if offset else 1))
    x = _leaf(*shape, dtype=dtype, seed=1)
    ref = hf(x)
    ref_grads = _grads(ref, x, hf.weight)
    ours = rms_norm(x, hf.weight, 1e-6, offset=offset)
    assert ours.dtype == ref.dtype
    _check((ours, *_grads(ours, x, hf.weight)), (ref, *ref_grads), dtype)
    assert implementation("rms_norm", x.device) == ("torch" if backend == "torch" else "npu:npu_rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hf_cls,offset,shape", [
    (modeling_llama.LlamaRMSNorm, False, (3, 7, 40)),
    (GemmaRMSNorm, True, (2, 5, 24)),
])
def test_add_rms_norm_matches_hf_add_then_norm(hf_cls, offset, shape, dtype, backend):
    """HF's `hidden = residual + x; normed = norm(hidden)`, both outputs used downstream (the residual stream goes
    on), against the fused entry point: both outputs and the gradients of residual, x and the weight."""
    hf = hf_cls(shape[-1], eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(shape[-1]) * 0.1 + (0 if offset else 1))
    residual, x = _leaf(*shape, dtype=dtype, seed=11), _leaf(*shape, dtype=dtype, seed=12)
    hidden = residual + x
    ref = (hf(hidden), hidden)
    ours = add_rms_norm(residual, x, hf.weight, 1e-6, offset=offset)
    assert [t.dtype for t in ours] == [dtype, dtype]

    def grads(outs):
        torch.manual_seed(0)
        loss = sum((o.float() * torch.randn_like(o.float())).sum() for o in outs)
        return torch.autograd.grad(loss, (residual, x, hf.weight))

    _check((*ours, *grads(ours)), (*ref, *grads(ref)), dtype)
    assert implementation("add_rms_norm", x.device) == ("torch" if backend == "torch" else "npu:npu_add_rms_norm")


def test_add_rms_norm_only_the_norm_used(backend):
    """The residual output unused (the last layer's): its gradient is the norm's alone."""
    hf = modeling_llama.LlamaRMSNorm(16, eps=1e-6)
    residual, x = _leaf(2, 3, 16, dtype=torch.float32, seed=13), _leaf(2, 3, 16, dtype=torch.float32, seed=14)
    ref = torch.autograd.grad(hf(residual + x).square().sum(), (residual, x, hf.weight))
    ours = torch.autograd.grad(add_rms_norm(residual, x, hf.weight, 1e-6)[0].square().sum(), (residual, x, hf.weight))
    _check(ours, ref, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hf_rope,rotary_frac", [(modeling_llama.apply_rotary_pos_emb, 1.0),
                                                 (modeling_phi3.apply_rotary_pos_emb, 0.5)])
def test_rope_matches_hf(hf_rope, rotary_frac, dtype, backend):
    batch, heads, kv_heads, seq, dim = 3, 6, 2, 11, 20
    rot = int(dim * rotary_frac)
    q = _leaf(batch, heads, seq, dim, dtype=dtype, seed=2)
    k = _leaf(batch, kv_heads, seq, dim, dtype=dtype, seed=3)
    angles = torch.randn(batch, seq, rot // 2)
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    ref = hf_rope(q, k, cos, sin)
    ref_grads = _grads(torch.cat([ref[0].flatten(), ref[1].flatten()]), q, k)
    ours = apply_rotary_pos_emb(q, k, cos, sin)
    ours_grads = _grads(torch.cat([ours[0].flatten(), ours[1].flatten()]), q, k)
    _check((*ours, *ours_grads), (*ref, *ref_grads), dtype)


def test_rope_with_fp32_tables_on_bf16_heads_is_hf(backend):
    """Under autocast q / k leave their projection in bf16 while cos / sin stay fp32: HF's `q * cos` promotes and
    returns fp32; so does ours (npu_rotary_mul takes one dtype: the promoted one)."""
    q = _leaf(2, 4, 9, 16, dtype=torch.bfloat16, seed=6)
    k = _leaf(2, 2, 9, 16, dtype=torch.bfloat16, seed=7)
    emb = torch.randn(2, 9, 8).repeat(1, 1, 2)
    ref = modeling_llama.apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
    ours = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
    assert [t.dtype for t in ours] == [t.dtype for t in ref] == [torch.float32] * 2
    _check(ours, ref, torch.float32)


def test_rope_bsnd_layout(backend):
    q = _leaf(2, 9, 4, 16, dtype=torch.float32, seed=4)  # [B, S, N, D] with unsqueeze_dim=2
    k = _leaf(2, 9, 2, 16, dtype=torch.float32, seed=5)
    emb = torch.randn(2, 9, 8).repeat(1, 1, 2)
    ref = modeling_llama.apply_rotary_pos_emb(q, k, emb.cos(), emb.sin(), unsqueeze_dim=2)
    ours = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin(), unsqueeze_dim=2)
    _check(ours, ref, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_hf_mlp_math(dtype, backend):
    gate = _leaf(3, 7, 33, dtype=dtype, seed=6)
    up = _leaf(3, 7, 33, dtype=dtype, seed=7)
    ref = F.silu(gate) * up
    ours = swiglu(gate, up)
    _check((ours, *_grads(ours, gate, up)), (ref, *_grads(ref, gate, up)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_swiglu_matches_phi3_mlp(dtype, backend):
    from transformers import Phi3Config

    mlp = modeling_phi3.Phi3MLP(Phi3Config(hidden_size=24, intermediate_size=34)).to(dtype)
    x = _leaf(2, 5, 24, dtype=dtype, seed=8)
    ref = mlp(x)
    ref_grads = _grads(ref, x, mlp.gate_up_proj.weight)
    ours = mlp.down_proj(swiglu_packed(mlp.gate_up_proj(x)))
    _check((ours, *_grads(ours, x, mlp.gate_up_proj.weight)), (ref, *ref_grads), dtype)


def test_npu_path_really_calls_torch_npu(monkeypatch, backend):
    """The npu backend must go through torch_npu (not silently through the torch reference)."""
    import torch_npu

    calls = []
    for name in ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_add_rms_norm", "npu_rms_norm_backward"):
        original = getattr(torch_npu, name)
        monkeypatch.setattr(torch_npu, name, lambda *a, _o=original, _n=name, **kw: calls.append(_n) or _o(*a, **kw))
    x = torch.randn(2, 4, 3, 8)
    rms_norm(x, torch.ones(8), 1e-6)
    apply_rotary_pos_emb(x, x, torch.ones(2, 3, 8), torch.zeros(2, 3, 8))
    swiglu(x, x)
    add_rms_norm(x, x.clone().requires_grad_(), torch.ones(8), 1e-6)[0].sum().backward()
    expected = ["npu_rms_norm", "npu_rotary_mul", "npu_rotary_mul", "npu_swiglu", "npu_add_rms_norm",
                "npu_rms_norm_backward"] if backend == "npu" else []
    assert calls == expected
