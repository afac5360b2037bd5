"""The vision ops on their own: ops.vision_attention (one call for all segments) equals HF's per-image loop of SDPA
calls, forward and backward, for equal, mixed and windowed segment lengths; on the npu backend it is one TND
npu_fusion_attention call; the vision rope equals HF's apply_rotary_pos_emb_vision (fp32 math, cast back)."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision as hf_vision_rope

from mindspeed_hf.device import import_torch_npu
from mindspeed_hf.ops.rotary import apply_rotary_pos_emb_vision
from mindspeed_hf.ops.vision_attention import vision_attention

HEADS, DIM = 2, 16
CASES = {"windows": [16] * 6, "mixed": [64, 16, 32, 16], "one_image": [48]}


def _hf_loop(q, k, v, lengths, scale):
    """What HF's vision attention does under sdpa: one call per segment."""
    outs = [F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in seg), scale=scale)
            for seg in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
    return torch.cat([o[0].transpose(0, 1) for o in outs])


def _inputs(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3, HEADS, DIM, generator=gen, requires_grad=True)
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return qkv, cu


@pytest.mark.parametrize("case", sorted(CASES))
def test_vision_attention_equals_hf_loop(case, backend, monkeypatch):
    lengths = CASES[case]
    qkv, cu = _inputs(lengths)
    grad_out = torch.randn(sum(lengths), HEADS, DIM)
    expected = _hf_loop(*qkv.unbind(1), lengths, DIM**-0.5)
    (expected_grad,) = torch.autograd.grad(expected, qkv, grad_out)

    npu, calls = import_torch_npu(), []
    real = npu.npu_fusion_attention
    monkeypatch.setattr(npu, "npu_fusion_attention", lambda *a, **kw: calls.append((a[4], kw)) or real(*a, **kw))
    out = vision_attention(*qkv.unbind(1), cu, DIM**-0.5)
    (grad,) = torch.autograd.grad(out, qkv, grad_out)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-5)
    if backend == "npu":
        assert len(calls) == 1 and calls[0][0] == "TND"
        ends = tuple(cu[1:].tolist())
        assert calls[0][1]["actual_seq_qlen"] == calls[0][1]["actual_seq_kvlen"] == ends
        assert calls[0][1].get("atten_mask") is None
    else:
        assert calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vision_rope_equals_hf(dtype, backend):
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(40, HEADS, DIM, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    freqs = torch.randn(40, DIM // 2, generator=gen)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    expected = hf_vision_rope(q, k, cos, sin)
    out = apply_rotary_pos_emb_vision(q, k, cos, sin)
    for got, want in zip(out, expected):
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(sum(t.float().sum() for t in out), (q, k))
    expected_grads = torch.autograd.grad(sum(t.float().sum() for t in expected), (q, k))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
