"""RMSNorm: y = x / rms(x) * w, or * (1 + w) in the offset form (Gemma); and the residual add fused into it:
hidden = residual + x, normed = rms_norm(hidden) (a decoder layer's add-then-norm).

The torch reference follows HF's casting exactly: the plain form normalises in fp32, casts back to the input
dtype, then multiplies by the weight; the offset form multiplies in fp32 and casts last. On NPU the add and the
norm are one npu_add_rms_norm call, which has no autograd of its own: its backward is npu_rms_norm's registered
derivative (npu_rms_norm_backward) on the saved sum and rstd, plus the residual stream's own gradient.
"""

from __future__ import annotations

import torch

from ..device import import_torch_npu
from .registry import register, run


def _normalise(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool):
    """HF's RMSNorm forward, op for op (its bits): (output, fp32 normalised x, fp32 rstd)."""
    x32 = x.to(torch.float32)
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    normed = x32 * rstd
    if offset:
        return (normed * (1.0 + weight.float())).to(x.dtype), normed, rstd
    return weight * normed.to(x.dtype), normed, rstd


def _normalise_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                        offset: bool, weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(d x in fp32, d weight) of `_normalise`, from the input and its rstd; HF's casts, in closed form."""
    normed = x.to(torch.float32) * rstd  # the forward's bits again
    if offset:
        grad32 = grad.to(torch.float32)
        d_normed = grad32 * (1.0 + weight.float())
        d_weight = (grad32 * normed).reshape(-1, normed.shape[-1]).sum(0).to(weight.dtype) if weight_grad else None
    else:
        d_normed = (grad * weight).to(x.dtype).to(torch.float32)  # HF's casts: to the input dtype, then fp32
        d_weight = ((grad * normed.to(x.dtype)).reshape(-1, normed.shape[-1]).sum(0).to(weight.dtype)
                    if weight_grad else None)
    # d/dx of x * rsqrt(mean(x^2) + eps): rstd * (g - x_hat * mean(g * x_hat))
    return (d_normed - normed * (d_normed * normed).mean(-1, keepdim=True)) * rstd, d_weight


class _RMSNorm(torch.autograd.Function):
    """The torch backend's RMSNorm: HF's forward bits; for the backward it keeps the input and the per-row rstd
    only (HF's autograd keeps the fp32 normalised copy too: one activation more per norm) and runs the closed-form
    gradient, about half of HF's backward ops. Gradients equal HF's within fp32 rounding."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
        out, _, rstd = _normalise(x, weight, eps, offset)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        d_x, d_weight = _normalise_backward(grad, x, weight, rstd, ctx.offset, ctx.needs_input_grad[1])
        return d_x.to(x.dtype), d_weight, None, None


class _AddRMSNorm(torch.autograd.Function):
    """hidden = residual + x and its RMSNorm in one autograd node (as _RMSNorm; the sum is kept, not the input)."""

    @staticmethod
    def forward(ctx, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool):
        hidden = residual + x
        out, _, rstd = _normalise(hidden, weight, eps, offset)
        ctx.save_for_backward(hidden, weight, rstd)
        ctx.offset, ctx.dtypes = offset, (residual.dtype, x.dtype)
        return out, hidden

    @staticmethod
    def backward(ctx, d_out: torch.Tensor | None, d_hidden: torch.Tensor | None):
        hidden, weight, rstd = ctx.saved_tensors
        d_sum, d_weight = d_hidden, None
        if d_out is not None:
            d_x, d_weight = _normalise_backward(d_out, hidden, weight, rstd, ctx.offset, ctx.needs_input_grad[2])
            d_x = d_x.to(hidden.dtype)
            d_sum = d_x if d_sum is None else d_sum + d_x
        residual_dtype, x_dtype = ctx.dtypes
        return d_sum.to(residual_dtype), d_sum.to(x_dtype), d_weight, None, None


# From this many elements on, the torch backend's norms run as the Functions above: from there the backward's saved
# normalised copy is memory worth keeping out (one activation per norm) and the fewer backward ops outweigh an
# autograd Function's Python (~20-40 us a call in a real step). Below it torch's own ops run: HF's graph, its bits.
LEAN_FROM_ELEMENTS = 1 << 17


def _lean(x: torch.Tensor, *inputs: torch.Tensor) -> bool:
    return x.numel() >= LEAN_FROM_ELEMENTS and torch.is_grad_enabled() and any(t.requires_grad for t in inputs)


@register("rms_norm", "torch", name="torch")
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    if _lean(x, x, weight):
        return _RMSNorm.apply(x, weight, eps, offset)
    if x.dtype == weight.dtype == torch.float32 and x.is_cpu:
        # torch's own rms_norm: one dispatched op for HF's five, the same bits forward and backward in fp32 on CPU
        # (no casts to reorder; tests/ops/test_rms_norm_torch.py checks it against HF's modules on the torch CI
        # installs: 2.13 at both ends of the tested range)
        return torch.rms_norm(x, (x.shape[-1],), (1.0 + weight) if offset else weight, eps)
    return _normalise(x, weight, eps, offset)[0]


@register("rms_norm", "npu", name="npu:npu_rms_norm")
def rms_norm_npu(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    # The op wants gamma in the input dtype; it multiplies in fp32 internally (last-bit bf16 drift vs HF).
    gamma = (1.0 + weight.float()) if offset else weight
    return import_torch_npu().npu_rms_norm(x, gamma.to(x.dtype), epsilon=eps)[0]


@register("rms_norm", "cuda", name="cuda:liger_rms_norm")
def rms_norm_liger(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    casting = "gemma" if offset else "llama"
    return LigerRMSNormFunction.apply(x, weight, eps, 1.0 if offset else 0.0, casting, False)


@register("add_rms_norm", "torch", name="torch")
def add_rms_norm_torch(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                       offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if residual.shape == x.shape and _lean(x, residual, x, weight):
        return _AddRMSNorm.apply(residual, x, weight, eps, offset)
    hidden = residual + x
    return rms_norm_torch(hidden, weight, eps, offset), hidden


class _NpuAddRmsNorm(torch.autograd.Function):
    """npu_add_rms_norm forward; exact backward from the saved sum and rstd (the op has no autograd)."""

    @staticmethod
    def forward(ctx, residual: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor, eps: float):
        normed, rstd, hidden = import_torch_npu().npu_add_rms_norm(residual, x, gamma, epsilon=eps)
        ctx.save_for_backward(hidden)  # the big one, through the saved-tensor hooks (activation offload sees it)
        ctx.gamma, ctx.rstd = gamma, rstd  # small, and not outputs (no reference cycle through ctx)
        return normed, hidden

    @staticmethod
    def backward(ctx, d_normed: torch.Tensor | None, d_hidden: torch.Tensor | None):
        (hidden,), gamma, rstd = ctx.saved_tensors, ctx.gamma, ctx.rstd
        d_sum, d_gamma = d_hidden, None
        if d_normed is not None:
            dx, d_gamma = import_torch_npu().npu_rms_norm_backward(d_normed, hidden, gamma, rstd)
            d_sum = dx if d_sum is None else dx + d_sum
            d_gamma = d_gamma.to(gamma.dtype)
        return d_sum, d_sum, d_gamma, None


@register("add_rms_norm", "npu", name="npu:npu_add_rms_norm")
def add_rms_norm_npu(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                     offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if residual.dtype != x.dtype or residual.shape != x.shape:  # outside the op's contract: HF's math, unfused
        return add_rms_norm_torch(residual, x, weight, eps, offset)
    gamma = (1.0 + weight.float()) if offset else weight
    return _NpuAddRmsNorm.apply(residual, x, gamma.to(x.dtype), eps)


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) with the backend for `x`'s device: a decoder layer's residual add and
    the norm after it in one kernel where the backend has one. `offset=True` scales by (1 + weight)."""
    fused = run("add_rms_norm", x.device)
    run("rms_norm", x.device)  # the norm ran on our kernel too: report()["ran"] counts it as an rms_norm as well
    return fused(residual, x, weight, eps, offset)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """RMSNorm of `x` over its last dim with the backend for `x`'s device. `offset=True` scales by (1 + weight)."""
    return run("rms_norm", x.device)(x, weight, eps, offset)
