"""Rotary position embedding of diffusers' denoisers: out = x * cos + rotate(x) * sin, computed in fp32 and cast
back to x's dtype (what diffusers' `apply_rotary_emb` does), with 4-D x and cos/sin tables broadcast against it.

- "interleave": rotate pairs (x[2i], x[2i+1]) -> (-x[2i+1], x[2i]), the tables repeat each frequency twice: Flux,
  Flux.2, HunyuanVideo (`use_real_unbind_dim=-1`), Qwen-Image (its complex frequencies written as such tables) and
  Wan's 3-D video rope (time / height / width frequencies side by side in one table).
- "half": rotate halves (x1, x2) -> (-x2, x1) (`use_real_unbind_dim=-2`).

The npu backend runs npu_rotary_mul in fp32 (the op takes one dtype for x and the tables; diffusers computes in
fp32 too) where its contract allows: 4-D, D even and < 896, B and N < 1000, and in interleave mode only tables of
the fully broadcast forms [1, 1, S, D] / [1, S, 1, D] / [S, 1, 1, D]. Anything else runs the same math unfused.
"""

from __future__ import annotations

import torch

from ..device import import_torch_npu
from .registry import register, run

_NPU_MAX_HEAD_DIM = 896
_NPU_MAX_BATCH_OR_HEADS = 1000
MODES = ("interleave", "half")


def _rotate(x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((-imag, real), dim=-1).flatten(-2)


@register("dit_rope", "torch", name="torch")
def dit_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> torch.Tensor:
    return (x.float() * cos + _rotate(x, mode).float() * sin).to(x.dtype)


def _npu_fits(x: torch.Tensor, cos: torch.Tensor, mode: str) -> bool:
    d = x.shape[-1]
    if x.dim() != 4 or cos.dim() != 4 or d % 2 or d >= _NPU_MAX_HEAD_DIM or cos.shape[-1] != d:
        return False
    a, b, c = x.shape[:3]
    # (table form, B, N) of each layout: BNSD takes 11SD (half mode also B1SD), BSND 1S1D (BS1D), SBND S11D (SB1D)
    forms = [((1, 1, c, d), a, b), ((1, b, 1, d), a, c), ((a, 1, 1, d), b, c)]
    if mode == "half":
        forms += [((a, 1, c, d), a, b), ((a, b, 1, d), a, c), ((a, b, 1, d), b, c)]
    return any(tuple(cos.shape) == form and batch < _NPU_MAX_BATCH_OR_HEADS and heads < _NPU_MAX_BATCH_OR_HEADS
               for form, batch, heads in forms)


@register("dit_rope", "npu", name="npu:npu_rotary_mul")
def dit_rope_npu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> torch.Tensor:
    if not _npu_fits(x, cos, mode):
        return dit_rope_torch(x, cos, sin, mode)
    out = import_torch_npu().npu_rotary_mul(x.float(), cos.float(), sin.float(), rotary_mode=mode)
    return out.to(x.dtype)


def dit_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str = "interleave") -> torch.Tensor:
    """Rotate `x` (4-D) by the fp32 tables `cos` / `sin` (broadcastable to x) with the backend for x's device."""
    return run("dit_rope", x.device)(x, cos, sin, mode)


def complex_tables(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Complex frequencies [..., D/2] (Qwen-Image's `freqs_cis`) as interleave-mode tables [..., D] (each
    frequency's cos / sin twice, side by side)."""
    return (freqs.real.float().repeat_interleave(2, dim=-1), freqs.imag.float().repeat_interleave(2, dim=-1))
