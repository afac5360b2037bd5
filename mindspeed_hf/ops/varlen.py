"""Variable-length (TND) bookkeeping for fused attention: which tokens are real, where each sequence ends.

npu_fusion_attention's TND layout wants the real tokens of a batch laid end to end and the HOST list of cumulative
end offsets (no leading 0). Reading those offsets back from the device is a host sync, so they are computed once per
forward step and reused by every layer: the cache is keyed on the identity (and in-place version) of the tensor
that describes the batch (the 2-D padding mask, the packed-sequence ids or the collator's cu_seq_lens), and it keeps
a reference to that tensor so that its id cannot be reused by another tensor while the entry lives.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

# Entries live a few forward steps at most: full and sliding layers each hold one entry per step, and an
# evaluation step may interleave with a training step.
_CACHE_SIZE = 8
_cache: OrderedDict[tuple[str, int, int], tuple[torch.Tensor, VarlenInfo]] = OrderedDict()


@dataclass(frozen=True)
class VarlenInfo:
    """How a [B, S] batch maps onto the TND token axis.

    indices: flat positions (into B*S) of the real tokens, in order; None when every position is a real token.
    cu_seqlens: host tuple of cumulative end offsets of the sequences along TND's token axis, no leading 0.
    contiguous: every sequence occupies consecutive positions of its row (so distances, hence sliding windows,
        are the same before and after unpadding).
    total: B * S, the length of the padded flat axis.
    """

    indices: torch.Tensor | None
    cu_seqlens: tuple[int, ...]
    contiguous: bool
    total: int

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1] if self.cu_seqlens else 0

    def is_dense(self, batch: int) -> bool:
        """Every position of the [batch, S] batch is a real token and every row is one whole sequence: the plain
        causal batch, for which no description is needed."""
        return self.indices is None and len(self.cu_seqlens) == batch and self.num_tokens == self.total


def build_varlen_info(source: torch.Tensor, kind: str) -> VarlenInfo:
    """Compute a VarlenInfo (one host sync). `kind` says what `source` is:

    "padding": [B, S] mask, True/1 = real token (HF's 2-D attention mask).
    "sequence_ids": [B, S] integers, equal values = same packed sequence (HF's packed_sequence_mask); every
        position is a real token.
    "cu_seqlens": 1-D cumulative lengths WITH the leading 0 (DataCollatorWithFlattening's cu_seq_lens_q) over the
        flattened batch.
    """
    if kind == "padding":
        mask = source.bool()
        batch, seq = mask.shape
        flat = mask.reshape(-1)
        indices = flat.nonzero().reshape(-1)
        # A row is contiguous when at most one run of real tokens starts in it.
        starts = mask & ~torch.nn.functional.pad(mask, (1, 0), value=False)[:, :-1]
        ends = mask.sum(1).cumsum(0)
        # Drop empty rows (a fully padded row adds no token and the op does not take empty sequences).
        host = torch.cat([ends, (starts.sum(1) > 1).any().reshape(1).long()]).tolist()
        cu, noncontiguous = host[:-1], host[-1]
        cu = [end for i, end in enumerate(cu) if end != (cu[i - 1] if i else 0)]
        all_real = bool(cu) and cu[-1] == batch * seq
        return VarlenInfo(None if all_real else indices, tuple(cu), not noncontiguous, batch * seq)
    if kind == "sequence_ids":
        ids = source
        batch, seq = ids.shape
        # A sequence ends where the next id differs, and at every row end (sequences never span rows).
        last = torch.ones(batch, seq, dtype=torch.bool, device=ids.device)
        last[:, :-1] = ids[:, 1:] != ids[:, :-1]
        cu = (last.reshape(-1).nonzero().reshape(-1) + 1).tolist()
        return VarlenInfo(None, tuple(cu), True, batch * seq)
    if kind == "cu_seqlens":
        cu = [int(c) for c in source.reshape(-1).tolist()]
        cu = [end for prev, end in zip(cu, cu[1:]) if end != prev]
        return VarlenInfo(None, tuple(cu), True, cu[-1] if cu else 0)
    raise ValueError(f"unknown varlen source kind {kind!r}")


def _version(t: torch.Tensor) -> int:
    try:
        return t._version  # bumps on in-place writes: a reused, rewritten mask is not a stale hit
    except RuntimeError:  # inference-mode tensors have no version counter (and cannot be written outside it)
        return -1


def varlen_info(source: torch.Tensor, kind: str) -> VarlenInfo:
    """build_varlen_info, memoised on the identity and version of `source` (so once per forward step)."""
    key = (kind, id(source), _version(source))
    hit = _cache.get(key)
    if hit is not None and hit[0] is source:
        _cache.move_to_end(key)
        return hit[1]
    info = build_varlen_info(source, kind)
    _cache[key] = (source, info)
    while len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return info


def clear_cache() -> None:
    """Forget every cached VarlenInfo (tests, or to release the tensors they hold)."""
    _cache.clear()


def unpad(x: torch.Tensor, info: VarlenInfo) -> torch.Tensor:
    """[B, N, S, D] (HF's layout) -> [T, N, D] with only the real tokens (TND)."""
    batch, heads, seq, dim = x.shape
    flat = x.transpose(1, 2).reshape(batch * seq, heads, dim)
    return flat if info.indices is None else flat.index_select(0, info.indices)


def pad(x: torch.Tensor, info: VarlenInfo, batch: int, seq: int) -> torch.Tensor:
    """[T, N, D] -> [B, S, N, D], zeros at the padded positions (HF's attention output layout)."""
    if info.indices is not None:
        full = x.new_zeros(info.total, *x.shape[1:])
        x = full.index_copy(0, info.indices, x)  # out of place: differentiable w.r.t. x
    return x.reshape(batch, seq, *x.shape[1:])
