"""npu_rms_norm, npu_rms_norm_backward and npu_add_rms_norm: RMSNorm in fp32, gamma applied in fp32, then cast
(the kernel's order)."""

from __future__ import annotations

import torch

from . import _checks as C


def _check_norm_args(op: str, x: torch.Tensor, gamma: object, epsilon: object) -> torch.Tensor:
    if gamma is None:
        raise RuntimeError(f"{op}: gamma is required (got None)")
    gamma = C.float_tensor(op, "gamma", gamma)
    C.real(op, "epsilon", epsilon)
    C.check(
        gamma.dtype == x.dtype, op,
        f"gamma dtype {gamma.dtype} must equal the input dtype {x.dtype} (cast the weight first)",
    )
    C.same_device(op, input=x, gamma=gamma)
    g = gamma.dim()
    C.check(1 <= g <= x.dim(), op, f"gamma must have 1..{x.dim()} dims, got {g}")
    C.check(
        tuple(gamma.shape) == tuple(x.shape[x.dim() - g:]), op,
        f"gamma shape {tuple(gamma.shape)} must equal the trailing input shape {tuple(x.shape[x.dim() - g:])}",
    )
    return gamma


def _rms_norm(x32: torch.Tensor, gamma: torch.Tensor, epsilon: float, dtype: torch.dtype):
    dims = tuple(range(x32.dim() - gamma.dim(), x32.dim()))
    rstd = torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = (x32 * rstd * gamma.float()).to(dtype)
    return y, rstd


def _rms_norm_grads(dy, x, gamma, rstd):
    """(dx in x's dtype, dgamma fp32) of y = x * rstd * gamma, computed in fp32 from the saved rstd."""
    g = gamma.dim()
    dims = tuple(range(x.dim() - g, x.dim()))
    with torch.no_grad():
        normed = x.float() * rstd
        dnormed = dy.float() * gamma.float()
        dx = rstd * (dnormed - normed * (dnormed * normed).mean(dim=dims, keepdim=True))
        dgamma = (dy.float() * normed).sum(dim=tuple(range(x.dim() - g)))
    return dx.to(x.dtype), dgamma


class _RmsNorm(torch.autograd.Function):
    """npu_rms_norm with its registered derivative: the backward is npu_rms_norm_backward's math (as on the device,
    where derivatives.yaml maps npu_rms_norm's gradient to npu_rms_norm_backward)."""

    @staticmethod
    def forward(ctx, x, gamma, epsilon):
        y, rstd = _rms_norm(x.float(), gamma, epsilon, x.dtype)
        ctx.save_for_backward(x, gamma, rstd)
        ctx.mark_non_differentiable(rstd)
        return y, rstd

    @staticmethod
    def backward(ctx, dy, _drstd):
        x, gamma, rstd = ctx.saved_tensors
        dx, dgamma = _rms_norm_grads(dy, x, gamma, rstd)
        return dx, dgamma.to(gamma.dtype), None


def npu_rms_norm(input, gamma, epsilon=1e-06):
    """(y, rstd): y = input * rsqrt(mean(input^2) + eps) * gamma, computed in fp32 and cast to input's dtype.

    rstd is fp32 with shape input.shape[:-g] + (1,) * g, g = gamma.dim(). Differentiable in input and gamma (through
    npu_rms_norm_backward's math, as on the device).
    """
    op = "npu_rms_norm"
    x = C.float_tensor(op, "input", input)
    gamma = _check_norm_args(op, x, gamma, epsilon)
    return _RmsNorm.apply(x, gamma, float(epsilon))


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06):
    """(y, rstd, x) with x = x1 + x2 (the new residual) and y = rms_norm(x) * gamma. No autograd on the device."""
    op = "npu_add_rms_norm"
    x1 = C.float_tensor(op, "x1", x1)
    x2 = C.float_tensor(op, "x2", x2)
    C.same_dtype(op, x1=x1, x2=x2)
    C.check(x1.shape == x2.shape, op, f"x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} must have one shape")
    gamma = _check_norm_args(op, x1, gamma, epsilon)
    with torch.no_grad():
        s32 = x1.float() + x2.float()
        y, rstd = _rms_norm(s32, gamma, float(epsilon), x1.dtype)
        x = s32.to(x1.dtype)
    return C.no_autograd(op, (y, rstd, x), (x1, x2, gamma))


def npu_rms_norm_backward(dy, self, gamma, rstd):
    """(dx, dgamma) of y = self * rstd * gamma (npu_rms_norm's registered derivative, callable on its own).

    dx has self's dtype; dgamma is float32 with gamma's shape (the caller casts it to gamma's dtype). rstd must be
    npu_rms_norm's (fp32, shape self.shape[:-g] + (1,) * g). Computed in fp32; no autograd through it.
    """
    op = "npu_rms_norm_backward"
    x = C.float_tensor(op, "self", self)
    dy = C.float_tensor(op, "dy", dy)
    rstd = C.float_tensor(op, "rstd", rstd)
    gamma = _check_norm_args(op, x, gamma, 1e-6)
    C.same_dtype(op, dy=dy, self=x)
    C.same_device(op, dy=dy, self=x, rstd=rstd)
    C.check(dy.shape == x.shape, op, f"dy {tuple(dy.shape)} and self {tuple(x.shape)} must have one shape")
    C.check(rstd.dtype == torch.float32, op, f"rstd must be float32 (npu_rms_norm's), got {rstd.dtype}")
    g = gamma.dim()
    want = tuple(x.shape[: x.dim() - g]) + (1,) * g
    C.check(tuple(rstd.shape) == want, op, f"rstd shape {tuple(rstd.shape)} must be {want}")
    return C.no_autograd(op, _rms_norm_grads(dy, x, gamma, rstd), (dy, x, gamma, rstd))
