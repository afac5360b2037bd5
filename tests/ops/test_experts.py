"""The experts kernel alone (ops/experts.py) against HF's eager experts loop (transformers >= 5 fused experts):
forward and backward, fp32 1e-5 and bf16 2e-2, odd shapes, empty experts, top-k 1/2/8, the expert-parallel
sentinel id, on the torch backend (torch._grouped_mm where it applies, the loop elsewhere) and on the NPU path
through the stand-in, with the device ops counted."""

from __future__ import annotations

import pytest
import torch

from mindspeed_hf.ops.experts import experts_mlp, grouped_mlp, permute, unpermute
from mindspeed_hf.releases import compat

pytestmark = pytest.mark.skipif(compat.experts_registry() is None,
                                reason="fused 3-D experts (the reference) need transformers >= 5")

# (tokens, hidden, intermediate, experts, top_k, experts used): odd sizes take the loop (unaligned strides)
CASES = {
    "aligned_top2": (9, 16, 8, 8, 2, None),
    "odd_top2": (7, 12, 6, 5, 2, None),
    "odd_top1": (13, 10, 7, 6, 1, None),
    "top8": (6, 16, 8, 8, 8, None),
    "empty_experts": (11, 16, 8, 6, 2, (0, 3, 5)),
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _hf_experts(hidden: int, inter: int, experts: int, dtype: torch.dtype):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts)
    config._experts_implementation = "eager"  # HF's own per-expert loop
    module = Qwen3MoeExperts(config)
    torch.nn.init.normal_(module.gate_up_proj, std=0.3)
    torch.nn.init.normal_(module.down_proj, std=0.3)
    return module.to(dtype)


def _routing(tokens: int, experts: int, top_k: int, used, gen: torch.Generator):
    pool = torch.tensor(used) if used else torch.arange(experts)
    k = min(top_k, pool.numel())
    index = torch.stack([pool[torch.randperm(pool.numel(), generator=gen)[:k]] for _ in range(tokens)])
    return index


def _inputs(case: str, dtype: torch.dtype):
    tokens, hidden, inter, experts, top_k, used = CASES[case]
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    module = _hf_experts(hidden, inter, experts, dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
    index = _routing(tokens, experts, top_k, used, gen)
    weights = torch.rand(tokens, index.shape[1], generator=gen).to(dtype).requires_grad_()
    return module, x, index, weights


def _forward_backward(fn, module, x, index, weights, grad_out=None):
    out = fn(x, index, weights)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype) \
        if grad_out is None else grad_out
    grads = torch.autograd.grad(out, (x, weights, module.gate_up_proj, module.down_proj), grad_out)
    return out, grads


def _assert_close(actual, expected, dtype, what):
    """fp32: 1e-5; bf16: 2e-2 of the tensor's scale (HF's bf16 loop itself rounds each of the k sums)."""
    tol = TOLERANCE[dtype]
    atol = tol if dtype == torch.float32 else tol * float(expected.detach().abs().max())
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=tol, msg=lambda m: f"{what}: {m}")


@pytest.fixture
def npu_calls(monkeypatch):
    """Count the torch_npu MoE ops (the stand-in) our kernel calls."""
    import torch_npu

    calls = {"npu_grouped_matmul": 0, "npu_moe_token_permute": 0, "npu_moe_token_unpermute": 0, "npu_swiglu": 0}
    for name in calls:
        original = getattr(torch_npu, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch_npu, name, counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_hf_eager_experts(case, dtype, backend, npu_calls):
    module, x, index, weights = _inputs(case, dtype)
    expected, expected_grads = _forward_backward(module, module, x, index, weights)
    out, grads = _forward_backward(
        lambda h, i, w: experts_mlp(h, i, w, module.gate_up_proj, module.down_proj), module, x, index, weights)
    assert out.dtype == dtype
    _assert_close(out, expected, dtype, "output")
    for name, got, want in zip(("x", "weights", "gate_up_proj", "down_proj"), grads, expected_grads):
        _assert_close(got, want, dtype, f"grad {name}")
    if backend == "npu":  # forward: permute, 2 grouped matmuls, swiglu, unpermute; backward: dX and dW per matmul
        assert npu_calls == {"npu_grouped_matmul": 6, "npu_moe_token_permute": 1, "npu_moe_token_unpermute": 1,
                             "npu_swiglu": 1}
    else:
        assert not any(npu_calls.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_backend_uses_grouped_mm_where_aligned(dtype, monkeypatch):
    calls = []
    original = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or original(*a, **k))
    module, x, index, weights = _inputs("aligned_top2", dtype)
    experts_mlp(x, index, weights, module.gate_up_proj, module.down_proj).float().sum().backward()
    assert len(calls) == 2  # gate_up and down
    calls.clear()
    module, x, index, weights = _inputs("odd_top2", dtype)  # rows of H=12, I=6 elements
    experts_mlp(x, index, weights, module.gate_up_proj, module.down_proj)
    # fp32: 48-byte rows fit gate_up, 24-byte ones do not fit down (the loop); bf16: neither (24 and 12 bytes)
    assert len(calls) == (1 if dtype == torch.float32 else 0)


def test_expanded_incoming_gradient_and_repeated_steps_stay_exact(backend):
    """out.sum().backward() hands a stride-0 gradient (torch._grouped_mm rejects it); a second step must not read
    uninitialised rows (NaN) either."""
    module, x, index, weights = _inputs("aligned_top2", torch.float32)
    for step in range(2):
        expected = torch.autograd.grad(module(x, index, weights).sum(), (module.gate_up_proj, module.down_proj))
        got = torch.autograd.grad(experts_mlp(x, index, weights, module.gate_up_proj, module.down_proj).sum(),
                                  (module.gate_up_proj, module.down_proj))
        for g, e in zip(got, expected):
            assert torch.isfinite(g).all(), step
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
        index = index.roll(1, dims=0)


def test_sentinel_expert_id_contributes_nothing(backend):
    """HF's expert-parallel "not on this rank" id (== num_experts) is skipped, as the eager loop skips it."""
    module, x, index, weights = _inputs("aligned_top2", torch.float32)
    index = index.clone()
    index[::3, 0] = module.num_experts
    expected, expected_grads = _forward_backward(module, module, x, index, weights)
    out, grads = _forward_backward(
        lambda h, i, w: experts_mlp(h, i, w, module.gate_up_proj, module.down_proj), module, x, index, weights)
    _assert_close(out, expected, torch.float32, "output")
    for got, want in zip(grads, expected_grads):
        _assert_close(got, want, torch.float32, "grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_biased_transposed_experts_with_their_own_gate(dtype, backend):
    """GPT-OSS's experts: [E, H, 2I] / [E, I, H] weights, per-expert biases, an interleaved clamped gate passed as
    apply_gate: grouped_mlp's layout keywords against HF's eager GptOssExperts."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=6, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    module = GptOssExperts(config)
    for param in module.parameters():
        torch.nn.init.normal_(param, std=0.3)
    module = module.to(dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 16, generator=gen).to(dtype).requires_grad_()
    index = _routing(9, 6, 2, (0, 2, 3, 5), gen)
    weights = torch.rand(9, 2, generator=gen).to(dtype).requires_grad_()
    params = (x, weights, module.gate_up_proj, module.down_proj, module.gate_up_proj_bias, module.down_proj_bias)
    grad_out = torch.randn(9, 16, generator=gen).to(dtype)
    expected = module(x, index, weights)
    expected_grads = torch.autograd.grad(expected, params, grad_out)
    out = experts_mlp(x, index, weights, module.gate_up_proj, module.down_proj, module._apply_gate,
                      gate_up_bias=module.gate_up_proj_bias, down_bias=module.down_proj_bias, transposed=True)
    _assert_close(out, expected, dtype, "output")
    for got, want in zip(torch.autograd.grad(out, params, grad_out), expected_grads):
        _assert_close(got, want, dtype, "grad")


def test_public_pieces_compose_and_check_counts(backend):
    """permute -> grouped_mlp -> unpermute is the kernel (what expert parallelism calls between its exchanges),
    and grouped_mlp names a counts mismatch before any work."""
    module, x, index, weights = _inputs("odd_top2", torch.float32)
    rows, routing = permute(x, index, module.num_experts)
    assert routing.counts.tolist() == torch.bincount(index.reshape(-1), minlength=module.num_experts).tolist()
    out = unpermute(grouped_mlp(rows, routing.counts, module.gate_up_proj, module.down_proj), routing, weights)
    torch.testing.assert_close(out, module(x, index, weights), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="counts"):
        grouped_mlp(rows, [1] * module.num_experts, module.gate_up_proj, module.down_proj)
    empty = grouped_mlp(rows[:0], [0] * module.num_experts, module.gate_up_proj, module.down_proj)
    empty.sum().backward()  # no rows: still reaches the weights (a zero gradient), for a rank without tokens
    assert module.gate_up_proj.grad is not None and not module.gate_up_proj.grad.any()
