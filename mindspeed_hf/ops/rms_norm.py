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
from .registry import has_own_kernel, register, run


@register("rms_norm", "torch", name="torch")
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    if x.dtype == weight.dtype == torch.float32 and x.is_cpu:
        # torch's own rms_norm: the same bits forward and backward in fp32 on CPU (no casts to reorder;
        # tests/ops/test_rms_norm_fp32.py checks it against HF's modules on the torch CI installs: 2.13 at both ends
        # of the tested range). One fused op without autograd; under autograd torch 2.13 runs HF's decomposition
        # itself (pow, mean, add, rsqrt, mul): no fewer ops then, and no slower (docs/host_time.md)
        return torch.rms_norm(x, (x.shape[-1],), (1.0 + weight) if offset else weight, eps)
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (1.0 + weight.float())).to(input_dtype)
    return weight * normed.to(input_dtype)


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


def add_rms_norm_fuses(device: torch.device | str) -> bool:
    """Whether the backend for `device` has an add+norm kernel of its own (npu). Elsewhere add_rms_norm is HF's add
    and norm, the same ops a decoder layer runs itself: there the layer's own forward runs, with less Python (the
    fused layer forward cost 26 us more per layer than HF's on the torch backend, docs/host_time.md), its norms on
    the rms_norm kernel (liger's on CUDA)."""
    return has_own_kernel("add_rms_norm", device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """RMSNorm of `x` over its last dim with the backend for `x`'s device. `offset=True` scales by (1 + weight)."""
    return run("rms_norm", x.device)(x, weight, eps, offset)
