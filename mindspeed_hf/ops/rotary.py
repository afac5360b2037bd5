"""Rotary position embedding of q and k in HF's "half" convention: x * cos + rotate_half(x) * sin.

Partial rotary (cos narrower than the head, as in Phi-3) rotates the leading part and keeps the rest.

The torch path computes rotate_half(x) * sin as x.roll(half) * signed_sin, where signed_sin is sin with its first
half negated: the same values exactly (negating a factor negates a product exactly), in two ops per tensor instead
of two slices, a negation, a concatenation and a product, and in backward a product and a roll instead of the
slices' zero-filled gradients, the negation and the split; the rest is HF's x * cos + rotated, so outputs and
gradients are HF's bit for bit. signed_sin is made once per table (the layers of a forward share theirs while the
backward keeps it) and is what the backward keeps in place of sin: nothing more than HF keeps. Held only weakly, it
never outlives its users: under activation checkpointing (whose forward saves nothing) each call makes its own.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from ..device import import_torch_npu
from .registry import register, run, select

# npu_rotary_mul limits (torch_npu_ops.md): 4-D input, D even and < 896, B and N < 1000.
_NPU_MAX_HEAD_DIM = 896
_NPU_MAX_BATCH_OR_HEADS = 1000


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_one_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x * cos) + (_rotate_half(x) * sin)


_signs: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _half_signs(x: torch.Tensor) -> torch.Tensor:
    """[-1] * half + [1] * (dim - half) in x's dtype and device, made once (never an inference tensor: a table that
    requires grad saves it for the backward of its product)."""
    dim = x.shape[-1]
    key = (dim, x.dtype, x.device)
    signs = None if torch.compiler.is_compiling() else _signs.get(key)
    if signs is None:
        with torch.inference_mode(False):
            signs = torch.ones(dim, dtype=x.dtype, device=x.device)
            signs[: dim // 2] = -1
        if not torch.compiler.is_compiling():
            _signs[key] = signs
    return signs


try:  # torch's selective activation checkpointing: the modes of its forward and of its recompute
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    _SELECTIVE_CHECKPOINT_MODES: tuple[type, ...] = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)
except ImportError:  # a torch that names them otherwise: every dispatch mode is taken for one
    _SELECTIVE_CHECKPOINT_MODES = (object,)


def _selective_checkpointing() -> bool:
    """Inside torch's selective activation checkpointing (its forward or its recompute), whose dispatch modes match
    each op of a region by its position: what a region dispatches must not depend on what an earlier region made."""
    depth = torch._C._len_torch_dispatch_stack()
    return bool(depth) and any(isinstance(torch._C._get_dispatch_stack_at(i), _SELECTIVE_CHECKPOINT_MODES)
                               for i in range(depth))


class _PerTables:
    """What a rope derives from its cos / sin tables, made once per set of tables: a forward hands every layer the
    same tables, so the first layer makes it and the rest share it while the backward keeps it (each layer's product
    saves it, where HF's saves sin). Held weakly: alive only while something else holds it, so it never adds a table
    to what HF's code keeps. Where nothing saves it - activation checkpointing's forward, no grad - each call makes
    its own and drops it (a checkpointed layer's recompute makes it again for its backward). Made again for other
    tables, under another inference mode or after a table changed in place, and every time while torch.compile
    traces, inside selective activation checkpointing (the recompute must dispatch what the forward did) or where a
    table requires grad."""

    def __init__(self) -> None:
        # (weak references to the tables, inference mode, versions, weak references to what was made)
        self._last: tuple | None = None

    def __call__(self, tables: tuple[torch.Tensor, ...], make: Callable[[], tuple[torch.Tensor, ...]],
                 how: object = None) -> tuple[torch.Tensor, ...]:
        """make(), or what it made for these `tables` (and `how`, what else it depends on) last time, if that is
        still alive."""
        if torch.compiler.is_compiling() or _selective_checkpointing() or any(t.requires_grad for t in tables):
            return make()
        inference = torch.is_inference_mode_enabled()
        # (an inference tensor keeps no version)
        versions = (how, *(None if t.is_inference() else t._version for t in tables))
        last = self._last
        if last is not None and last[1] is inference and last[2] == versions \
                and all(ref() is t for ref, t in zip(last[0], tables)):
            made = tuple(ref() for ref in last[3])
            if all(t is not None for t in made):
                return made
        made = make()
        self._last = (tuple(weakref.ref(t, self._forget) for t in tables), inference, versions,
                      tuple(weakref.ref(t) for t in made))
        return made

    def _forget(self, table: weakref.ref) -> None:
        """A table died: drop what was made from it (if it is still the one kept)."""
        last = self._last
        if last is not None and table in last[0]:
            self._last = None


_signed = _PerTables()
_doubled = _PerTables()


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated (x.roll(half) * this == rotate_half(x) * sin exactly), made once per table."""
    return _signed((sin,), lambda: (sin * _half_signs(sin),))[0]


def _rope_one_rolled(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """_rope_one_torch's result, bit for bit, with rotate_half(x) * sin as x.roll(half) * signed_sin (module
    docstring)."""
    return (x * cos) + (x.roll(x.shape[-1] // 2, -1) * signed_sin)


def _promoted(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """x, cos, sin in the dtype HF's `x * cos` gives them (PyTorch's promotion): under autocast q / k come out of
    their projection in bf16 while the tables stay fp32, so HF rotates them in fp32; the fused ops take one dtype."""
    dtype = torch.promote_types(x.dtype, cos.dtype)
    return x.to(dtype), cos.to(dtype), sin.to(dtype)


def _rope_one_npu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    if x.dim() != 4 or d % 2 or d >= _NPU_MAX_HEAD_DIM or max(x.shape[0], x.shape[1]) >= _NPU_MAX_BATCH_OR_HEADS:
        return _rope_one_torch(x, cos, sin)  # outside the op's domain: same math, unfused
    return import_torch_npu().npu_rotary_mul(*_promoted(x, cos, sin), rotary_mode="half")


def _apply(rope_one, q, k, cos, sin, unsqueeze_dim):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    if rotary_dim == q.shape[-1]:
        return rope_one(q, cos, sin), rope_one(k, cos, sin)
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    return (
        torch.cat([rope_one(q_rot, cos, sin), q_pass], dim=-1),
        torch.cat([rope_one(k_rot, cos, sin), k_pass], dim=-1),
    )


@register("rope", "torch", name="torch")
def rope_torch(q, k, cos, sin, unsqueeze_dim=1):
    if sin.shape[-1] % 2:  # an odd width, where the roll is not rotate_half: HF's way
        return _apply(_rope_one_torch, q, k, cos, sin, unsqueeze_dim)
    return _apply(_rope_one_rolled, q, k, cos, _signed_sin(sin), unsqueeze_dim)


@register("rope", "npu", name="npu:npu_rotary_mul")
def rope_npu(q, k, cos, sin, unsqueeze_dim=1):
    return _apply(_rope_one_npu, q, k, cos, sin, unsqueeze_dim)


@register("rope", "cuda", name="cuda:liger_rope")
def rope_liger(q, k, cos, sin, unsqueeze_dim=1):
    if unsqueeze_dim != 1 or cos.shape[-1] != q.shape[-1]:
        return rope_torch(q, k, cos, sin, unsqueeze_dim)  # liger's kernel expects BNSD and a full-width rotary
    from liger_kernel.ops.rope import LigerRopeFunction

    q, cos, sin = _promoted(q, cos, sin)
    return LigerRopeFunction.apply(q, k.to(q.dtype), cos, sin, None, unsqueeze_dim)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for HF's `apply_rotary_pos_emb` (same signature), dispatched on q's device."""
    return run("rope", q.device)(q, k, cos, sin, unsqueeze_dim)


def _first_half_doubled(cos: torch.Tensor, sin: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width tables of the "half" layout from the first `width` angles of each: cat(t[..., :width] twice), made
    once per forward."""
    return _doubled((cos, sin), lambda: tuple(torch.cat((t[..., :width], t[..., :width]), -1) for t in (cos, sin)),
                    width)


def apply_rotary_pos_emb_half_width(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's rope: each half of q / k turned against the other by half-width tables (first * cos - second * sin,
    second * cos + first * sin), which is the "half" rope on the tables doubled, bit for bit."""
    cos, sin = _first_half_doubled(cos, sin, cos.shape[-1])
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


def _pairs_apart(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): interleaved pairs laid out as two halves."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def apply_rotary_pos_emb_interleaved(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's interleaved rope (`apply_rotary_pos_emb_interleave`): each pair (x0, x1), (x2, x3), ... turned by
    one angle of the tables' first half, the results laid out evens then odds. That is the "half" rope of q / k with
    their pairs laid apart, on the first half doubled, bit for bit (HF's tables repeat their angles in the second
    half: transformers 4.57 reads the whole table, 5.x the first half, and both give these numbers)."""
    cos, sin = _first_half_doubled(cos, sin, cos.shape[-1] // 2)
    return apply_rotary_pos_emb(_pairs_apart(q), _pairs_apart(k), cos, sin, unsqueeze_dim)


def multimodal_rope_tables(cos: torch.Tensor, sin: torch.Tensor, mrope_section: list[int],
                           interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rope tables [3, B, T, D] (temporal, height, width rows) folded into the one [B, T, D] table each
    that plain rope takes, with no host read: contiguous sections (Qwen2-VL: the i-th section of each half comes from
    row i % 3) or interleaved (Qwen3-TTS / Qwen3-VL style: in the first half, channel c < 3 * section[r] with
    c % 3 == r comes from row r, the rest from row 0; the second half repeats the first)."""
    def contiguous(table: torch.Tensor) -> torch.Tensor:
        parts = table.split(list(mrope_section) * 2, dim=-1)
        return torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)

    def interleave(table: torch.Tensor) -> torch.Tensor:
        half = table[..., : table.shape[-1] // 2]
        rows = len(mrope_section)
        folded = half[0].clone()
        for row, size in enumerate(mrope_section[1:], 1):
            folded[..., row:size * rows:rows] = half[row, ..., row:size * rows:rows]
        return torch.cat([folded, folded], dim=-1)

    fold = interleave if interleaved else contiguous
    return fold(cos), fold(sin)


def _rope_one_npu_bsnd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [1, S, N, D] with cos/sin [1, S, 1, D]: npu_rotary_mul's BSND form (B = 1, N = heads)."""
    d = x.shape[-1]
    if d % 2 or d >= _NPU_MAX_HEAD_DIM or x.shape[2] >= _NPU_MAX_BATCH_OR_HEADS:
        return _rope_one_torch(x, cos, sin)
    return import_torch_npu().npu_rotary_mul(*_promoted(x, cos, sin), rotary_mode="half")


def apply_rotary_pos_emb_vision(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for the Qwen-VL vision towers' `apply_rotary_pos_emb_vision`: q/k [S, N, D] (packed patches of all
    images), cos/sin [S, D]; computed in fp32 and cast back to q's / k's dtype, as HF does. The npu backend runs
    npu_rotary_mul on the [1, S, N, D] view; cuda and torch the same math unfused (liger's rope wants BNSD)."""
    rope_one = _rope_one_npu_bsnd if select("rope", q.device).backend == "npu" else _rope_one_torch
    run("rope", q.device)  # counted: the fp32 vision rope below is ours on every backend
    cos, sin = (t.float()[None, :, None, :] for t in (cos, sin))
    q_out, k_out = (rope_one(x.float().unsqueeze(0), cos, sin)[0] for x in (q, k))
    return q_out.to(q.dtype), k_out.to(k.dtype)
