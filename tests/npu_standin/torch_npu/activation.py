"""npu_swiglu: silu(A) * B over the two halves of `input` along `dim`, computed in fp32."""

from __future__ import annotations

import torch.nn.functional as F

from . import _checks as C


def npu_swiglu(input, dim=-1):
    """Split `input` in halves A, B along `dim`; return silu(A) * B (half the size on `dim`). Differentiable."""
    op = "npu_swiglu"
    x = C.float_tensor(op, "input", input)
    dim = C.integer(op, "dim", dim)
    C.check(-x.dim() <= dim < x.dim(), op, f"dim {dim} is out of range for a {x.dim()}-D input", IndexError)
    C.check(x.shape[dim] % 2 == 0, op, f"the size {x.shape[dim]} of dim {dim} must be even")
    a, b = x.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(x.dtype)
