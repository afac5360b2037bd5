"""npu_rotary_mul: out = r1 * x + r2 * rotate(x), 'half' (rotate_half) or 'interleave' (even/odd pairs).

The op takes no layout argument: the layout (BNSD, BSND or SBND) is read from the broadcast shape of r1/r2.
"""

from __future__ import annotations

import torch

from . import _checks as C

MAX_HEAD_DIM = 896  # D must be even and < 896
MAX_BATCH_OR_HEADS = 1000  # B and N must be < 1000
MAX_GRAD_BN = 1024  # gradient into r1/r2 needs B * N <= 1024


def _candidate_layouts(x_shape, r_shape, mode):
    """(layout, B, N) for every layout whose allowed r1/r2 broadcast shapes include r_shape."""
    a, b, c, d = x_shape
    forms = {  # layout: (B, N, [allowed r shapes]); interleave allows only the first (fully broadcast) form
        "BNSD": (a, b, [(1, 1, c, d), (a, 1, c, d), (a, b, c, d)]),
        "BSND": (a, c, [(1, b, 1, d), (a, b, 1, d), (a, b, c, d)]),
        "SBND": (b, c, [(a, 1, 1, d), (a, b, 1, d), (a, b, c, d)]),
    }
    found = []
    for layout, (batch, heads, shapes) in forms.items():
        allowed = shapes[:1] if mode == "interleave" else shapes
        if tuple(r_shape) in allowed:
            found.append((layout, batch, heads))
    return found


def _rotate(x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):
    """Rotary embedding: r1 * x + r2 * rotate(x); with r1=cos, r2=sin, 'half' is HF's apply_rotary_pos_emb.

    All inputs 4-D and of one dtype; D even and < 896; B, N < 1000. r1/r2 shapes (half): BNSD input with
    11SD/B1SD/BNSD, BSND with 1S1D/BS1D/BSND, SBND with S11D/SB1D/SBND; interleave: only 11SD/1S1D/S11D.
    Differentiable in input, r1 and r2 (the r1/r2 gradient needs B * N <= 1024).
    """
    op = "npu_rotary_mul"
    x = C.float_tensor(op, "input", input)
    r1 = C.float_tensor(op, "r1", r1)
    r2 = C.float_tensor(op, "r2", r2)
    mode = C.string(op, "rotary_mode", rotary_mode)
    if rotate is not None:
        raise C.unsupported(op, "the `rotate` matrix input (torch-npu >= 2.14)")
    C.check(mode in ("half", "interleave"), op, f"rotary_mode must be 'half' or 'interleave', got {mode!r}", ValueError)
    for name, t in (("input", x), ("r1", r1), ("r2", r2)):
        C.check(t.dim() == 4, op, f"{name} must be 4-D (BNSD, BSND or SBND), got shape {tuple(t.shape)}")
    C.same_dtype(op, input=x, r1=r1, r2=r2)
    C.same_device(op, input=x, r1=r1, r2=r2)
    C.check(r1.shape == r2.shape, op, f"r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} must have one shape")
    d = x.shape[-1]
    C.check(d % 2 == 0 and 0 < d < MAX_HEAD_DIM, op, f"head dim D={d} must be even and < {MAX_HEAD_DIM}")
    layouts = _candidate_layouts(x.shape, r1.shape, mode)
    C.check(
        bool(layouts), op,
        f"unsupported r1/r2 shape {tuple(r1.shape)} for input {tuple(x.shape)} in {mode!r} mode "
        "(allowed: 11SD/B1SD/BNSD, 1S1D/BS1D/BSND, S11D/SB1D/SBND; interleave only the first of each)",
    )
    C.check(
        any(b < MAX_BATCH_OR_HEADS and n < MAX_BATCH_OR_HEADS for _, b, n in layouts), op,
        f"B and N must be < {MAX_BATCH_OR_HEADS} (input {tuple(x.shape)}, layouts {[lay for lay, _, _ in layouts]})",
    )
    if torch.is_grad_enabled() and (r1.requires_grad or r2.requires_grad):
        C.check(
            min(b * n for _, b, n in layouts) <= MAX_GRAD_BN, op,
            f"the gradient into r1/r2 needs B * N <= {MAX_GRAD_BN}",
        )
    x32 = x.float()
    out = r1.float() * x32 + r2.float() * _rotate(x32, mode)
    return out.to(x.dtype)
