"""Tests OF the torch_npu stand-in's fused attention (layouts, sparse modes, varlen, grad op) and of the
argument checks every op enforces: what must raise on the device must raise here."""

from __future__ import annotations

import math
import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch_npu  # noqa: E402

ATOL = 1e-5
MAX = 2147483647


# ----------------------------------------------------------------------------------------------- attention


def sdpa_ref(q, k, v, keep=None, scale=None):
    """BNSD reference: SDPA with a boolean mask where True = KEEP, kv heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)


def causal_keep(sq, skv, bottom_right=False):
    shift = skv - sq if bottom_right else 0
    return torch.arange(skv)[None, :] <= torch.arange(sq)[:, None] + shift


def compressed_mask():
    return torch.triu(torch.ones(2048, 2048), diagonal=1).bool()


def qkv(b=2, nq=4, nkv=2, sq=6, skv=6, d=8, dv=None, grad=False):
    dv = dv or d
    ts = torch.randn(b, nq, sq, d), torch.randn(b, nkv, skv, d), torch.randn(b, nkv, skv, dv)
    return [t.requires_grad_(grad) for t in ts]


def test_fa_bnsd_full_gqa_matches_sdpa_with_grads():
    q, k, v = qkv(grad=True)
    scale = 1 / math.sqrt(8)
    out = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", scale=scale)[0]
    ref = sdpa_ref(q, k, v, scale=scale)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    dy = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dy), torch.autograd.grad(ref, (q, k, v), dy)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)


def test_fa_layouts_agree_and_value_dim_may_be_smaller():
    q, k, v = qkv(dv=4)
    want = sdpa_ref(q, k, v, scale=0.3)
    bsnd = [t.transpose(1, 2) for t in (q, k, v)]
    out = torch_npu.npu_fusion_attention(*bsnd, 4, "BSND", scale=0.3)[0]
    torch.testing.assert_close(out, want.transpose(1, 2), atol=ATOL, rtol=0)
    bsh = [t.flatten(2) for t in bsnd]
    out = torch_npu.npu_fusion_attention(*bsh, 4, "BSH", scale=0.3)[0]
    torch.testing.assert_close(out, want.transpose(1, 2).flatten(2), atol=ATOL, rtol=0)
    sbh = [t.transpose(0, 1).contiguous() for t in bsh]
    out = torch_npu.npu_fusion_attention(*sbh, 4, "SBH", scale=0.3)[0]
    torch.testing.assert_close(out, want.transpose(1, 2).flatten(2).transpose(0, 1), atol=ATOL, rtol=0)


def test_fa_causal_sparse_modes():
    q, k, v = qkv(sq=5, skv=7)
    top_left = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=compressed_mask(), sparse_mode=2)[0]
    torch.testing.assert_close(top_left, sdpa_ref(q, k, v, causal_keep(5, 7), scale=1.0), atol=ATOL, rtol=0)
    bottom_right = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=compressed_mask(), sparse_mode=3)[0]
    torch.testing.assert_close(bottom_right, sdpa_ref(q, k, v, causal_keep(5, 7, True), scale=1.0), atol=ATOL, rtol=0)
    full_mask = ~causal_keep(5, 7)  # True = masked
    mode1 = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=full_mask, sparse_mode=1)[0]
    torch.testing.assert_close(mode1, top_left, atol=ATOL, rtol=0)
    nothing_masked = torch.zeros(5, 7, dtype=torch.bool)
    mode0 = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=nothing_masked, next_tockens=0)[0]
    torch.testing.assert_close(mode0, top_left, atol=ATOL, rtol=0)


def test_fa_band_mode4_is_a_sliding_window():
    q, k, v = qkv()
    out = torch_npu.npu_fusion_attention(
        q, k, v, 4, "BNSD", atten_mask=compressed_mask(), sparse_mode=4, pre_tockens=2, next_tockens=0
    )[0]
    rel = torch.arange(6)[None, :] - torch.arange(6)[:, None]
    torch.testing.assert_close(out, sdpa_ref(q, k, v, (rel <= 0) & (rel >= -2), scale=1.0), atol=ATOL, rtol=0)


def test_fa_prefix_modes_5_and_6():
    q, k, v = qkv()
    prefix = [2, 4]
    keep = causal_keep(6, 6, True)[None] | (torch.arange(6)[None, None, :] < torch.tensor(prefix)[:, None, None])
    keep = keep.unsqueeze(1)  # [B,1,S,S]
    ref = sdpa_ref(q, k, v, keep, scale=1.0)
    mode5 = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=~keep, sparse_mode=5, prefix=prefix)[0]
    torch.testing.assert_close(mode5, ref, atol=ATOL, rtol=0)
    rect = torch.zeros(1024, 2048, dtype=torch.bool)
    rect[:, 1024:] = True
    compressed = torch.cat([compressed_mask(), rect])
    mode6 = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=compressed, sparse_mode=6, prefix=prefix)[0]
    torch.testing.assert_close(mode6, ref, atol=ATOL, rtol=0)
    with pytest.raises(RuntimeError, match="3072"):
        torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=compressed_mask(), sparse_mode=6, prefix=prefix)


def test_fa_b1ss_padding_mask_and_none_mask_ignores_sparse_mode():
    q, k, v = qkv()
    valid = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    keep = causal_keep(6, 6)[None, None] & valid[:, None, None, :]
    out = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=~keep, scale=0.5)[0]
    torch.testing.assert_close(out, sdpa_ref(q, k, v, keep, scale=0.5), atol=ATOL, rtol=0)
    as_uint8 = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=(~keep).to(torch.uint8), scale=0.5)[0]
    torch.testing.assert_close(as_uint8, out, atol=0, rtol=0)
    pad_keep = valid[:, None, None, :]  # [B,1,1,S] is a legal B1SS mask when Sq == 1 (decoding)
    decode = torch_npu.npu_fusion_attention(q[:, :, -1:], k, v, 4, "BNSD", atten_mask=~pad_keep)[0]
    torch.testing.assert_close(decode, sdpa_ref(q[:, :, -1:], k, v, pad_keep, scale=1.0), atol=ATOL, rtol=0)
    full = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=None, sparse_mode=3, scale=0.5)[0]
    torch.testing.assert_close(full, sdpa_ref(q, k, v, scale=0.5), atol=ATOL, rtol=0)


def test_fa_softmax_stats_and_outputs():
    q, k, v = qkv()
    out, smax, ssum, reserved, seed, offset, numels = torch_npu.npu_fusion_attention(
        q, k, v, 4, "BNSD", atten_mask=compressed_mask(), sparse_mode=2, scale=0.4
    )
    assert smax.shape == ssum.shape == (2, 4, 6, 8) and smax.dtype == ssum.dtype == torch.float32
    assert reserved.numel() == 0 and (seed, offset, numels) == (0, 0, 2 * 4 * 6 * 6)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.4).masked_fill(~causal_keep(6, 6), -math.inf)
    torch.testing.assert_close(smax[..., 0] + ssum[..., 0].log(), scores.logsumexp(-1), atol=ATOL, rtol=0)
    assert torch.equal(smax[..., 0:1].expand(-1, -1, -1, 8), smax)


def _tnd(lens_q, lens_kv, nq=4, nkv=2, d=8, grad=False):
    ts = torch.randn(sum(lens_q), nq, d), torch.randn(sum(lens_kv), nkv, d), torch.randn(sum(lens_kv), nkv, d)
    return [t.requires_grad_(grad) for t in ts]


def _cum(lens):
    return [int(x) for x in torch.tensor(lens).cumsum(0)]


def _per_segment_ref(q, k, v, lens_q, lens_kv, keep_fn, scale):
    outs, qs, ks = [], 0, 0
    for i, (a, b) in enumerate(zip(lens_q, lens_kv)):
        qi, ki, vi = (t.permute(1, 0, 2)[None] for t in (q[qs:qs + a], k[ks:ks + b], v[ks:ks + b]))
        outs.append(sdpa_ref(qi, ki, vi, keep_fn(i, a, b), scale=scale)[0].permute(1, 0, 2))
        qs, ks = qs + a, ks + b
    return torch.cat(outs)


def test_fa_tnd_varlen_causal_matches_per_segment_with_grads():
    lens = [2, 3, 4]
    q, k, v = _tnd(lens, lens, grad=True)
    out, smax, *_ = torch_npu.npu_fusion_attention(
        q, k, v, 4, "TND", atten_mask=compressed_mask(), sparse_mode=3, scale=0.35,
        actual_seq_qlen=_cum(lens), actual_seq_kvlen=tuple(_cum(lens)),
    )
    assert out.shape == (9, 4, 8) and smax.shape == (9, 4, 8)
    ref = _per_segment_ref(q, k, v, lens, lens, lambda i, a, b: causal_keep(a, b, True), 0.35)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    dy = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dy), torch.autograd.grad(ref, (q, k, v), dy)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)


def test_fa_tnd_context_parallel_modes_7_and_8():
    lens_q, lens_kv = [2, 3], [4, 6]
    q, k, v = _tnd(lens_q, lens_kv)
    seq = dict(actual_seq_qlen=_cum(lens_q), actual_seq_kvlen=_cum(lens_kv), atten_mask=compressed_mask())

    def band(a, b, pre, nxt):
        rel = torch.arange(b)[None, :] - torch.arange(a)[:, None] - (b - a)
        return (rel <= nxt) & (rel >= -pre)

    out7 = torch_npu.npu_fusion_attention(q, k, v, 4, "TND", sparse_mode=7, pre_tockens=6, next_tockens=-1, **seq)[0]
    ref7 = _per_segment_ref(
        q, k, v, lens_q, lens_kv, lambda i, a, b: band(a, b, 6, -1) if i == 1 else causal_keep(a, b, True), 1.0
    )
    torch.testing.assert_close(out7[0], ref7[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(out7, ref7, atol=ATOL, rtol=0)
    out8 = torch_npu.npu_fusion_attention(q, k, v, 4, "TND", sparse_mode=8, pre_tockens=4, next_tockens=1, **seq)[0]
    ref8 = _per_segment_ref(
        q, k, v, lens_q, lens_kv, lambda i, a, b: band(a, b, 4, 1) if i == 0 else causal_keep(a, b), 1.0
    )
    torch.testing.assert_close(out8, ref8, atol=ATOL, rtol=0)


def test_fa_grad_op_matches_autograd_gqa_causal():
    q, k, v = (t.transpose(1, 2).contiguous().requires_grad_() for t in qkv(sq=5, skv=7))
    kwargs = dict(atten_mask=compressed_mask(), sparse_mode=3)
    out, smax, ssum, _, seed, offset, numels = torch_npu.npu_fusion_attention(q, k, v, 4, "BSND", scale=0.3, **kwargs)
    dy = torch.randn_like(out)
    want = torch.autograd.grad(out, (q, k, v), dy)
    dq, dk, dv, dpse, dsink = torch_npu.npu_fusion_attention_grad(
        q, k, v, dy, 4, "BSND", softmax_max=smax, softmax_sum=ssum, attention_in=out, scale_value=0.3,
        seed=seed, offset=offset, numels=numels, **kwargs,
    )
    for a, b in zip((dq, dk, dv), want):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)
    assert dpse.numel() == 0 and dsink.numel() == 0 and not dq.requires_grad


def test_fa_dropout_is_reproducible_from_seed_and_matches_grad_op():
    q, k, v = qkv(grad=True)
    out, smax, ssum, _, seed, offset, numels = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", keep_prob=0.5)
    assert seed != 0
    no_drop = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD")[0]
    assert not torch.allclose(out, no_drop, atol=1e-3)
    again = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", keep_prob=0.5, seed=seed, offset=offset)[0]
    torch.testing.assert_close(again, out, atol=0, rtol=0)
    dy = torch.randn_like(out)
    want = torch.autograd.grad(out, (q, k, v), dy)
    got = torch_npu.npu_fusion_attention_grad(
        q, k, v, dy, 4, "BNSD", softmax_max=smax, softmax_sum=ssum, attention_in=out, keep_prob=0.5,
        seed=seed, offset=offset, numels=numels,
    )[:3]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)


def test_fa_sdpa_polarity_mask_gives_a_different_result():
    q, k, v = qkv()
    keep = causal_keep(6, 6)
    right = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=~keep, sparse_mode=1)[0]
    torch.testing.assert_close(right, sdpa_ref(q, k, v, keep, scale=1.0), atol=ATOL, rtol=0)
    inverted = keep & ~torch.eye(6, dtype=torch.bool)  # SDPA polarity, diagonal kept so no row is empty
    wrong = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=inverted, sparse_mode=1)[0]
    assert not torch.allclose(wrong, right, atol=1e-3)
    with pytest.raises(RuntimeError, match="fully masked"):
        torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=keep, sparse_mode=1)


def test_fa_default_scale_is_one_not_inverse_sqrt_d():
    q, k, v = qkv()
    default = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD")[0]
    torch.testing.assert_close(default, sdpa_ref(q, k, v, scale=1.0), atol=ATOL, rtol=0)
    assert not torch.allclose(default, sdpa_ref(q, k, v), atol=1e-3)


def test_fa_fully_masked_rows_need_inner_precise_2():
    q, k, v = qkv(sq=7, skv=5)  # bottom-right causal with Sq > Skv leaves the first two rows empty
    with pytest.raises(RuntimeError, match="fully masked"):
        torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=compressed_mask(), sparse_mode=3)
    out = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=compressed_mask(), sparse_mode=3,
                                         inner_precise=2)[0]
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2])) and torch.isfinite(out).all()


# ----------------------------------------------------------------------------------------------- strictness


def _fa(layout="BNSD", **kw):
    q, k, v = kw.pop("qkv", None) or qkv()
    return lambda: torch_npu.npu_fusion_attention(q, k, v, kw.pop("head_num", 4), layout, **kw)


def _tnd_call(**kw):
    q, k, v = _tnd([2, 3], [2, 3])
    return lambda: torch_npu.npu_fusion_attention(q, k, v, 4, "TND", **kw)


def _gmm_call(groups, k_dim=4, dtype=torch.int64):
    x, w = torch.randn(groups, k_dim), torch.randn(groups, k_dim, 2)
    gl = torch.ones(groups, dtype=dtype)
    return lambda: torch_npu.npu_grouped_matmul([x], [w], group_list=gl, split_item=2, group_type=0,
                                                group_list_type=1)


STRICT = {
    "rms gamma dtype": (lambda: torch_npu.npu_rms_norm(torch.randn(2, 8).bfloat16(), torch.ones(8)), "dtype"),
    "rms gamma None": (lambda: torch_npu.npu_rms_norm(torch.randn(2, 8), None), "gamma"),
    "rms gamma shape": (lambda: torch_npu.npu_rms_norm(torch.randn(2, 8), torch.ones(4)), "shape"),
    "mask [B,1,1,S]": (_fa(atten_mask=torch.zeros(2, 1, 1, 6, dtype=torch.bool)), r"\[B,1,1,S\]"),
    "mask int": (_fa(atten_mask=torch.zeros(6, 6, dtype=torch.int32)), "bool or uint8"),
    "mask float": (_fa(atten_mask=torch.zeros(6, 6)), "bool or uint8"),
    "mask bad 4-D": (_fa(atten_mask=torch.zeros(2, 2, 6, 6, dtype=torch.bool)), "unsupported atten_mask shape"),
    "mode 2 small mask": (_fa(atten_mask=~causal_keep(6, 6), sparse_mode=2), "2048"),
    "mode 3 small mask": (_fa(atten_mask=torch.ones(1024, 1024).triu(1).bool(), sparse_mode=3), "2048"),
    "mode 3 tril mask": (_fa(atten_mask=~compressed_mask(), sparse_mode=3), "upper-triangular"),
    "mode 7 not TND": (_fa(atten_mask=compressed_mask(), sparse_mode=7), "TND"),
    "mode 9": (_fa(sparse_mode=9), "sparse_mode"),
    "Nq % Nkv": (_fa(qkv=qkv(nq=4, nkv=3)), "multiple of kv heads"),
    "head_num mismatch": (_fa(head_num=2), "head_num"),
    "head dim 769": (_fa(qkv=qkv(b=1, sq=2, skv=2, d=769)), "head dim"),
    "qkv dtype": (_fa(qkv=[qkv()[0].half(), *qkv()[1:]]), "one dtype"),
    "bad layout": (_fa(layout="BHSD"), "input_layout"),
    "BSND rank": (_fa(layout="BSND", qkv=[t[0] for t in qkv()]), "4-D"),
    "scale tensor": (_fa(scale=torch.tensor(0.1)), "float"),
    "pse": (_fa(pse=torch.zeros(2, 4, 6, 6)), "pse"),
    "seq_len on BNSD": (_fa(actual_seq_qlen=[6], actual_seq_kvlen=[6]), "TND"),
    "TND no seq": (_tnd_call(), "actual_seq_qlen"),
    "TND leading 0": (_tnd_call(actual_seq_qlen=[0, 2, 5], actual_seq_kvlen=[2, 5]), "leading 0"),
    "TND not ending at T": (_tnd_call(actual_seq_qlen=[2, 4], actual_seq_kvlen=[2, 5]), "end at"),
    "TND decreasing": (_tnd_call(actual_seq_qlen=[3, 2, 5], actual_seq_kvlen=[2, 5]), "increasing"),
    "TND tensor seq": (_tnd_call(actual_seq_qlen=torch.tensor([2, 5]), actual_seq_kvlen=[2, 5]), "host list"),
    "TND 4-D mask": (
        _tnd_call(actual_seq_qlen=[2, 5], actual_seq_kvlen=[2, 5], atten_mask=torch.zeros(1, 1, 3, 3).bool()),
        "TND takes only",
    ),
    "TND fully masked": (
        _tnd_call(actual_seq_qlen=[2, 5], actual_seq_kvlen=[2, 5], atten_mask=torch.ones(3, 3).bool(), sparse_mode=1),
        "fully masked",
    ),
    "rotary 3-D": (lambda: torch_npu.npu_rotary_mul(torch.randn(2, 5, 8), torch.ones(1, 5, 8),
                                                    torch.ones(1, 5, 8)), "4-D"),
    "rotary odd D": (lambda: torch_npu.npu_rotary_mul(torch.randn(1, 1, 2, 7), torch.ones(1, 1, 2, 7),
                                                      torch.ones(1, 1, 2, 7)), "even"),
    "rotary D 896": (lambda: torch_npu.npu_rotary_mul(torch.randn(1, 1, 1, 896), torch.ones(1, 1, 1, 896),
                                                      torch.ones(1, 1, 1, 896)), "< 896"),
    "rotary r shape": (lambda: torch_npu.npu_rotary_mul(torch.randn(2, 3, 5, 8), torch.ones(1, 3, 5, 8),
                                                        torch.ones(1, 3, 5, 8)), "unsupported r1/r2 shape"),
    "rotary interleave B1SD": (lambda: torch_npu.npu_rotary_mul(torch.randn(2, 3, 5, 8), torch.ones(2, 1, 5, 8),
                                                                torch.ones(2, 1, 5, 8), "interleave"), "interleave"),
    "rotary N 1000": (lambda: torch_npu.npu_rotary_mul(torch.randn(1, 1000, 1, 8), torch.ones(1, 1, 1, 8),
                                                       torch.ones(1, 1, 1, 8)), "< 1000"),
    "swiglu odd": (lambda: torch_npu.npu_swiglu(torch.randn(2, 5)), "even"),
    "ce int32 target": (lambda: torch_npu.npu_cross_entropy_loss(torch.randn(3, 5), torch.zeros(3, dtype=torch.int32)),
                        "int64"),
    "ce mean grad smoothing": (
        lambda: torch_npu.npu_cross_entropy_loss(torch.randn(3, 5, requires_grad=True), torch.zeros(3).long(),
                                                 label_smoothing=0.1),
        "defaults",
    ),
    "ce weight fp16": (lambda: torch_npu.npu_cross_entropy_loss(torch.randn(3, 5), torch.zeros(3).long(),
                                                                weight=torch.ones(5).half()), "float32"),
    "gmm 1025 groups": (_gmm_call(1025), "1024"),
    "gmm K 65536": (_gmm_call(2, k_dim=65536), "65536"),
    "gmm int32 group_list": (_gmm_call(2, dtype=torch.int32), "int64"),
    "gmm rows mismatch": (lambda: torch_npu.npu_grouped_matmul([torch.randn(5, 4)], [torch.randn(2, 4, 3)],
                                                               group_list=torch.tensor([2, 2]), split_item=2,
                                                               group_type=0, group_list_type=1), "covers"),
    "unpermute int64 idx": (lambda: torch_npu.npu_moe_token_unpermute(torch.randn(4, 2), torch.arange(4)), "int32"),
}


@pytest.mark.parametrize("case", sorted(STRICT))
def test_strict_inputs_raise(case):
    call, match = STRICT[case]
    with pytest.raises((RuntimeError, ValueError, TypeError, IndexError, NotImplementedError), match=match):
        call()
