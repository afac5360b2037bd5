"""Argument checks shared by the stand-in ops, and the wrapper for ops that have no autograd.

The real ops are C++ bindings: a wrong Python type raises TypeError at the binding, a wrong shape, dtype or value
raises RuntimeError from the kernel's parameter check. The stand-in follows the same split.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check(cond: bool, op: str, msg: str, exc: type[Exception] = RuntimeError) -> None:
    """Raise `exc` with an op-prefixed message unless `cond` holds."""
    if not cond:
        raise exc(f"{op}: {msg}")


def unsupported(op: str, what: str) -> NotImplementedError:
    """An input the real op accepts but this CPU stand-in does not model: fail loudly, never approximate."""
    return NotImplementedError(f"{op}: {what} is not modelled by the torch_npu CPU stand-in")


def tensor(op: str, name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}(): argument '{name}' must be Tensor, not {type(value).__name__}")
    return value


def float_tensor(op: str, name: str, value: object) -> torch.Tensor:
    t = tensor(op, name, value)
    check(t.dtype in FLOAT_DTYPES, op, f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    return t


def same_dtype(op: str, **tensors: torch.Tensor) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    check(len(set(dtypes.values())) == 1, op, f"inputs must share one dtype, got {dtypes}")


def same_device(op: str, **tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    check(len(set(devices.values())) == 1, op, f"inputs must be on one device, got {devices}")


def integer(op: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{op}(): argument '{name}' must be int, not {type(value).__name__}")
    return int(value)


def real(op: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}(): argument '{name}' must be float, not {type(value).__name__}")
    return float(value)


def string(op: str, name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{op}(): argument '{name}' must be str, not {type(value).__name__}")
    return value


def int_list(op: str, name: str, value: object) -> list[int]:
    """A host int[] argument: a list or tuple of Python ints (a device tensor is not a host list)."""
    if isinstance(value, torch.Tensor) or not isinstance(value, Sequence) or isinstance(value, str):
        raise TypeError(f"{op}(): argument '{name}' must be a host list/tuple of ints, not {type(value).__name__}")
    return [integer(op, f"{name}[{i}]", v) for i, v in enumerate(value)]


class _NoAutograd(torch.autograd.Function):
    """Carries outputs of an op without a registered derivative: the forward works, backward raises."""

    @staticmethod
    def forward(ctx, op, outputs, *inputs):  # noqa: ARG004 - inputs only link the graph
        ctx.op = op
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"the derivative for '{ctx.op}' is not implemented: torch_npu registers no autograd for this op; "
            "wrap it in your own torch.autograd.Function"
        )


def no_autograd(op: str, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Return `outputs` (computed without grad) so that a backward through them raises, as on the device."""
    outputs = tuple(o.detach() for o in outputs)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        return _NoAutograd.apply(op, outputs, *[t for t in inputs if isinstance(t, torch.Tensor)])
    return outputs
