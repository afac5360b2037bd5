"""Tests OF the torch_npu CPU stand-in: real 2.14.0 signatures, reference numerics, and the device's strictness."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re
import sys

import pytest
import torch
import torch.nn.functional as F

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch_npu  # noqa: E402

ATOL = 1e-5
MAX = 2147483647


# ----------------------------------------------------------------------------------------------- schemas


def _default(type_: str, text: str):
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    if type_.startswith("str"):
        return ast.literal_eval(text)
    return float(text) if type_.startswith("float") else int(text)


def _parse_schemas() -> dict[str, dict[str, list[tuple[str, bool, bool, object]]]]:
    """{version: {op: [(name, keyword_only, has_default, default)]}} from the copied schema file."""
    versions: dict = {}
    current = None
    for line in (HERE / "torch_npu_schemas.txt").read_text().splitlines():
        header = re.match(r"## torch-npu (\S+)", line)
        if header:
            current = versions.setdefault(header.group(1), {})
            continue
        if current is None or not line.strip() or line.startswith("#"):
            continue
        name, args = re.match(r"(\S+?)\((.*)\) -> ", line).groups()
        params, kw_only = [], False
        for arg in (a.strip() for a in args.split(",")):
            if arg == "*":
                kw_only = True
                continue
            type_, decl = arg.rsplit(" ", 1)
            pname, _, dtext = decl.partition("=")
            params.append((pname, kw_only, bool(dtext), _default(type_, dtext) if dtext else None))
        current[name] = params
    return versions


SCHEMAS = _parse_schemas()
OPS_2_14 = sorted(name for name in SCHEMAS["2.14.0"] if "." not in name)


def _standin_params(op: str):
    out = []
    for p in inspect.signature(getattr(torch_npu, op)).parameters.values():
        has_default = p.default is not inspect.Parameter.empty
        out.append((p.name, p.kind is inspect.Parameter.KEYWORD_ONLY, has_default, p.default if has_default else None))
    return out


def test_schema_file_has_both_versions():
    assert {"2.14.0", "2.6.0"} <= set(SCHEMAS)
    assert set(OPS_2_14) == set(torch_npu.__all__) - {"npu"}  # every stand-in op is held to a real schema


@pytest.mark.parametrize("op", OPS_2_14)
def test_signature_matches_2_14_schema(op):
    got, want = _standin_params(op), SCHEMAS["2.14.0"][op]
    assert [p[:3] for p in got] == [p[:3] for p in want]
    for (name, _, _, d_got), (_, _, _, d_want) in zip(got, want):
        assert d_got == d_want and type(d_got) is type(d_want), (op, name, d_got, d_want)


@pytest.mark.parametrize("op", sorted(n for n in SCHEMAS["2.6.0"] if "." not in n))
def test_2_6_arguments_are_accepted_unchanged(op):
    got = {name: (kw, has, d) for name, kw, has, d in _standin_params(op)}
    for name, kw, has, default in SCHEMAS["2.6.0"][op]:
        assert got[name] == (kw, has, default), (op, name)


def test_module_surface():
    assert torch_npu.__version__ == "2.14.0"
    torch_npu.npu.set_compile_mode(jit_compile=False)
    assert not hasattr(torch, "npu")
    assert callable(torch_npu.npu_fusion_attention_grad)


# ----------------------------------------------------------------------------------------------- norms


def hf_rms_norm(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def test_rms_norm_matches_hf_with_grads():
    x = torch.randn(2, 5, 16, requires_grad=True)
    g = torch.randn(16, requires_grad=True)
    y, rstd = torch_npu.npu_rms_norm(x, g, epsilon=1e-6)
    ref = hf_rms_norm(x, g, 1e-6)
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=0)
    assert rstd.dtype == torch.float32 and rstd.shape == (2, 5, 1)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, g), dy)
    want = torch.autograd.grad(ref, (x, g), dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5)


def test_rms_norm_bf16_multiplies_gamma_in_fp32_then_casts():
    x = torch.randn(4, 64).bfloat16()
    g = (torch.rand(64) + 0.5).bfloat16()
    y, rstd = torch_npu.npu_rms_norm(x, g)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, (x.float() * rstd * g.float()).bfloat16(), atol=0, rtol=0)


def test_rms_norm_two_dim_gamma_rstd_shape():
    _, rstd = torch_npu.npu_rms_norm(torch.randn(3, 4, 8), torch.ones(4, 8))
    assert rstd.shape == (3, 1, 1)


def test_add_rms_norm_forward_and_no_backward():
    x1, x2 = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8)
    g = torch.randn(8)
    y, rstd, x = torch_npu.npu_add_rms_norm(x1, x2, g)
    torch.testing.assert_close(x, x1 + x2, atol=ATOL, rtol=0)
    torch.testing.assert_close(y, hf_rms_norm(x1 + x2, g, 1e-6), atol=ATOL, rtol=0)
    with pytest.raises(RuntimeError, match="not implemented"):
        y.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_backward_equals_autograd_of_rms_norm(dtype):
    x = torch.randn(2, 5, 16).to(dtype).requires_grad_()
    g = (torch.randn(16) * 0.1 + 1).to(dtype).requires_grad_()
    y, rstd = torch_npu.npu_rms_norm(x, g)
    dy = torch.randn_like(y)
    want = torch.autograd.grad(y, (x, g), dy)
    dx, dgamma = torch_npu.npu_rms_norm_backward(dy, x.detach(), g.detach(), rstd.detach())
    assert dx.dtype == dtype and dgamma.dtype == torch.float32 and dgamma.shape == g.shape
    tol = dict(atol=ATOL, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(dx, want[0], **tol)
    torch.testing.assert_close(dgamma.to(dtype), want[1], **tol)


def test_rms_norm_backward_is_strict():
    x, g = torch.randn(3, 8), torch.randn(8)
    _, rstd = torch_npu.npu_rms_norm(x, g)
    with pytest.raises(RuntimeError, match="rstd must be float32"):
        torch_npu.npu_rms_norm_backward(x, x, g, rstd.half())
    with pytest.raises(RuntimeError, match="rstd shape"):
        torch_npu.npu_rms_norm_backward(x, x, g, rstd.reshape(1, 3))
    with pytest.raises(RuntimeError, match="gamma dtype"):
        torch_npu.npu_rms_norm_backward(x, x, g.half(), rstd)
    with pytest.raises(RuntimeError, match="not implemented"):  # no autograd through it, as on the device
        torch_npu.npu_rms_norm_backward(x.requires_grad_(), x, g, rstd)[0].sum().backward()


# ----------------------------------------------------------------------------------------------- rotary / swiglu


def hf_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _cos_sin(batch, seq, dim):
    freqs = torch.randn(batch, seq, dim // 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def test_rotary_half_matches_hf_with_grads():
    cos, sin = _cos_sin(2, 5, 8)
    cos, sin = cos.unsqueeze(1).requires_grad_(), sin.unsqueeze(1).requires_grad_()  # B1SD, HF's unsqueeze(1)
    q = torch.randn(2, 3, 5, 8, requires_grad=True)  # BNSD
    out = torch_npu.npu_rotary_mul(q, cos, sin)
    ref = hf_rope(q, cos, sin)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    dy = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, cos, sin), dy), torch.autograd.grad(ref, (q, cos, sin), dy)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5)


def test_rotary_bsnd_with_1s1d_tables():
    cos, sin = _cos_sin(1, 5, 8)
    q = torch.randn(2, 5, 3, 8)  # BSND
    out = torch_npu.npu_rotary_mul(q, cos.unsqueeze(2), sin.unsqueeze(2))
    torch.testing.assert_close(out, hf_rope(q, cos.unsqueeze(2), sin.unsqueeze(2)), atol=ATOL, rtol=0)


def test_rotary_interleave_rotates_even_odd_pairs():
    theta = torch.randn(5, 4)
    cos = theta.cos().repeat_interleave(2, -1).view(1, 1, 5, 8)
    sin = theta.sin().repeat_interleave(2, -1).view(1, 1, 5, 8)
    x = torch.randn(2, 3, 5, 8)
    out = torch_npu.npu_rotary_mul(x, cos, sin, rotary_mode="interleave")
    xc = torch.view_as_complex(x.view(2, 3, 5, 4, 2).contiguous())
    ref = torch.view_as_real(xc * torch.polar(torch.ones_like(theta), theta)).flatten(-2)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_swiglu_matches_silu_times_b_with_grads():
    x = torch.randn(3, 4, 10, requires_grad=True)
    out = torch_npu.npu_swiglu(x)
    a, b = x.chunk(2, -1)
    ref = F.silu(a) * b
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    dy = torch.randn_like(out)
    torch.testing.assert_close(
        torch.autograd.grad(out, x, dy)[0], torch.autograd.grad(ref, x, dy)[0], atol=ATOL, rtol=1e-5
    )
    x0 = torch.randn(6, 3)
    torch.testing.assert_close(torch_npu.npu_swiglu(x0, dim=0), F.silu(x0[:3]) * x0[3:], atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------------------------- MoE


def test_grouped_matmul_forward_counts_and_cumulative():
    x, w = torch.randn(7, 4), torch.randn(3, 4, 5)
    counts = torch.tensor([2, 0, 5])
    ref = torch.cat([x[:2] @ w[0], x[2:2] @ w[1], x[2:] @ w[2]])
    y = torch_npu.npu_grouped_matmul([x], [w], group_list=counts, split_item=2, group_type=0, group_list_type=1)
    assert isinstance(y, list) and len(y) == 1
    torch.testing.assert_close(y[0], ref, atol=ATOL, rtol=0)
    y0 = torch_npu.npu_grouped_matmul([x], [w], group_list=counts.cumsum(0), split_item=2, group_type=0,
                                      group_list_type=0)[0]
    torch.testing.assert_close(y0, ref, atol=ATOL, rtol=0)
    per_group = torch_npu.npu_grouped_matmul([x], list(w), group_list=[2, 2, 7], split_item=0, group_type=0)
    assert [t.shape[0] for t in per_group] == [2, 0, 5]


def test_grouped_matmul_weight_gradient_and_no_autograd():
    x, dy = torch.randn(7, 4, requires_grad=True), torch.randn(7, 5)
    counts = torch.tensor([3, 4])
    dw = torch_npu.npu_grouped_matmul([x.t()], [dy], group_list=counts, split_item=3, group_type=2,
                                      group_list_type=1)[0]
    torch.testing.assert_close(dw, torch.stack([x[:3].t() @ dy[:3], x[3:].t() @ dy[3:]]), atol=ATOL, rtol=0)
    with pytest.raises(RuntimeError, match="not implemented"):
        dw.sum().backward()


def test_moe_token_permute_unpermute_round_trip_with_grads():
    tokens = torch.randn(4, 3, requires_grad=True)
    indices = torch.tensor([[0, 4], [4, 3], [4, 2], [1, 1]])
    permuted, sorted_idx = torch_npu.npu_moe_token_permute(tokens, indices)
    assert sorted_idx.dtype == torch.int32 and permuted.shape == (8, 3)
    for i in range(8):
        assert torch.equal(permuted[sorted_idx[i]], tokens[i // 2])
    experts = indices.reshape(-1)[torch.argsort(sorted_idx.long())]
    assert torch.equal(experts, experts.sort().values)
    probs = torch.rand(4, 2, requires_grad=True)
    out = torch_npu.npu_moe_token_unpermute(permuted, sorted_idx, probs, restore_shape=[4, 3])
    ref = tokens * probs.sum(1, keepdim=True)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    dy = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (tokens, probs), dy), torch.autograd.grad(ref, (tokens, probs), dy)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5)
    dropped, _ = torch_npu.npu_moe_token_permute(tokens, indices, num_out_tokens=5)
    torch.testing.assert_close(dropped, permuted[:5], atol=0, rtol=0)


def test_moe_gating_top_k_softmax_and_init_routing():
    x = torch.randn(3, 6, requires_grad=True)
    finished = torch.tensor([False, True, False])
    y, expert_idx, row_idx = torch_npu.npu_moe_gating_top_k_softmax(x, finished, k=2)
    top = torch.softmax(x, -1).topk(2)
    torch.testing.assert_close(y, top.values, atol=ATOL, rtol=0)
    assert expert_idx.dtype == row_idx.dtype == torch.int32
    assert torch.equal(expert_idx[1], torch.tensor([6, 6], dtype=torch.int32))
    assert torch.equal(expert_idx[[0, 2]].long(), top.indices[[0, 2]])
    assert torch.equal(row_idx, torch.tensor([[0, 3], [1, 4], [2, 5]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="not implemented"):
        y.sum().backward()
    experts = torch.tensor([[2, 0], [1, 2], [0, 1]], dtype=torch.int32)
    feats = torch.randn(3, 4)
    ex, expanded_row, expanded_expert = torch_npu.npu_moe_init_routing(feats, row_idx, experts, active_num=3)
    assert expanded_expert.tolist() == [0, 0, 1, 1, 2, 2]
    sorted_rows = [2, 3, 1, 5, 0, 4]  # row_idx values ordered by (expert, row_idx)
    assert all(expanded_row[r] == i for i, r in enumerate(sorted_rows))
    torch.testing.assert_close(ex, feats[torch.tensor(sorted_rows) % 3], atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------- loss


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_torch_with_grads(reduction):
    logits = torch.randn(6, 5, requires_grad=True)
    target = torch.tensor([0, 4, -100, 2, 1, -100])
    loss, log_prob, zloss, lse = torch_npu.npu_cross_entropy_loss(logits, target, reduction=reduction)
    ref = F.cross_entropy(logits, target, reduction=reduction)
    assert loss.shape == ((6,) if reduction == "none" else (1,))
    torch.testing.assert_close(loss.reshape(ref.shape), ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(log_prob, torch.log_softmax(logits, -1), atol=ATOL, rtol=0)
    assert zloss.numel() == 0 and lse.numel() == 0
    dy = torch.randn_like(loss)
    torch.testing.assert_close(
        torch.autograd.grad(loss, logits, dy)[0], torch.autograd.grad(ref, logits, dy.reshape(ref.shape))[0],
        atol=ATOL, rtol=1e-5,
    )


def test_cross_entropy_loss_dtype_follows_logits_and_torch_options():
    logits = torch.randn(4, 7).bfloat16()
    loss = torch_npu.npu_cross_entropy_loss(logits, torch.tensor([1, 2, 3, 4]))[0]
    assert loss.dtype == torch.bfloat16 and loss.shape == (1,)
    x, t, w = torch.randn(5, 3), torch.tensor([0, 1, 2, 7, 1]), torch.rand(3)
    got = torch_npu.npu_cross_entropy_loss(x, t, weight=w, ignore_index=7, label_smoothing=0.2)[0]
    torch.testing.assert_close(got[0], F.cross_entropy(x, t, weight=w, ignore_index=7, label_smoothing=0.2),
                               atol=ATOL, rtol=0)
