"""Variable-length (TND) bookkeeping for fused attention: which tokens are real, where each sequence ends.

npu_fusion_attention's TND layout wants the real tokens of a batch laid end to end and the HOST list of cumulative
end offsets (no leading 0). Reading those offsets back from the device is a host sync, so they are computed once per
forward step and reused by every layer: the cache is keyed on the identity (and in-place version) of the tensor
that describes the batch (the 2-D padding mask, the packed-sequence ids or the collator's cu_seq_lens), and it keeps
a reference to that tensor so that its id cannot be reused by another tensor while the entry lives.
"""

from __future__ import annotations

import functools
import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

# Entries live a few forward steps at most: full and sliding layers each hold one entry per step, and an
# evaluation step may interleave with a training step.
_CACHE_SIZE = 8
_cache: OrderedDict[tuple[str, int, int], tuple[torch.Tensor, VarlenInfo]] = OrderedDict()


# Padding kept in place (see build_varlen_info) runs as sequences of at most this many tokens: each padded position
# then attends to at most this many others, however long the padding.
PAD_PIECE = 512


@dataclass(frozen=True)
class VarlenInfo:
    """How a [B, S] batch maps onto the TND token axis.

    indices: flat positions (into B*S) of the real tokens, in order, when only those are laid end to end; None when
        every position of the batch is on the TND axis (in order), padding included.
    cu_seqlens: host tuple of cumulative end offsets of the sequences along TND's token axis, no leading 0.
    contiguous: every sequence occupies consecutive positions of its row (so distances, hence sliding windows,
        are the same before and after unpadding).
    total: B * S, the length of the padded flat axis.
    keep: when padding is on the TND axis, [B*S, 1, 1] bool, True at the real tokens (pad() zeroes the rest).
    """

    indices: torch.Tensor | None
    cu_seqlens: tuple[int, ...]
    contiguous: bool
    total: int
    keep: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1] if self.cu_seqlens else 0

    def is_dense(self, batch: int) -> bool:
        """Every position of the [batch, S] batch is a real token and every row is one whole sequence: the plain
        causal batch, for which no description is needed."""
        return self.indices is None and len(self.cu_seqlens) == batch and self.num_tokens == self.total


def _padding_in_place(runs: list[tuple[int, int]], seq: int) -> tuple[int, ...]:
    """The cumulative ends that keep a padded batch in place: per row, its padding before the real run, the run,
    its padding after (each padding stretch cut into PAD_PIECE pieces). `runs` = (start, length) per row."""
    ends: list[int] = []
    for row, (start, length) in enumerate(runs):
        offset = row * seq
        for lo, hi, piece in ((0, start, PAD_PIECE), (start, start + length, length), (start + length, seq, PAD_PIECE)):
            if hi > lo:
                ends.extend(offset + min(end, hi) for end in range(lo + piece, hi + piece, piece))
    return tuple(ends)


def build_varlen_info(source: torch.Tensor, kind: str) -> VarlenInfo | None:
    """Compute a VarlenInfo (one host sync). `kind` says what `source` is:

    "padding": [B, S] mask, True/1 = real token (HF's 2-D attention mask). Where each row's real tokens are one
        run (right or left padding), the batch stays in place: the padding becomes sequences of its own that no
        real token sees, so nothing is gathered or scattered (pad() zeroes their outputs, as a gather would leave
        them: what HF's SDPA gives a left-padded row's fully masked queries). Padding with holes lays the real
        tokens end to end (`indices`).
    "sequence_ids": [B, S] integers, equal values = same packed sequence (HF's packed_sequence_mask); every
        position is a real token.
    "cu_seqlens": 1-D cumulative lengths WITH the leading 0 (DataCollatorWithFlattening's cu_seq_lens_q) over the
        flattened batch.
    "block_causal": a materialised [B, 1, S, S] mask; None unless it is exactly block-diagonal causal
        (block_causal_info).
    """
    if kind == "block_causal":
        return block_causal_info(source)
    if kind == "padding":
        mask = source.bool()
        batch, seq = mask.shape
        # Per row: its real tokens, where the first is, and how many runs of real tokens start in it.
        runs = (mask & ~torch.nn.functional.pad(mask, (1, 0), value=False)[:, :-1]).sum(1)
        lengths, firsts, counts = torch.stack([mask.sum(1), mask.int().argmax(1), runs]).tolist()
        if max(counts, default=0) <= 1:
            keep = None if sum(lengths) == batch * seq else mask.reshape(-1, 1, 1)
            return VarlenInfo(None, _padding_in_place(list(zip(firsts, lengths)), seq), True, batch * seq, keep)
        cu = list(itertools.accumulate(lengths))
        # Drop empty rows (a fully padded row adds no token and the op does not take empty sequences).
        cu = [end for i, end in enumerate(cu) if end != (cu[i - 1] if i else 0)]
        return VarlenInfo(mask.reshape(-1).nonzero().reshape(-1), tuple(cu), False, batch * seq)
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


def block_causal_info(mask: torch.Tensor) -> VarlenInfo | None:
    """The documents of a materialised [B, 1, S, S] mask that is exactly block-diagonal causal (LLaMA-Factory's
    neat_packing mask, a caller's own packed mask), or None for any other pattern. SDPA's conventions: bool True =
    attend, or additive float (0 = attend, <= half the dtype's lowest value or -inf = masked; any other value is a
    bias, not a boundary). A query with no key at all is padding (its output is not a document's). Exact: the mask
    is compared with the one its documents imply (one [B, S, S] comparison and one host read, memoised per mask).
    Padding stays in place as sequences of its own, as for a 2-D padding mask."""
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != mask.shape[3]:
        return None
    if mask.dtype == torch.bool:
        allowed = mask[:, 0]
    elif mask.is_floating_point():
        values = mask[:, 0]
        allowed = values == 0
        if not bool((allowed | (values <= torch.finfo(mask.dtype).min / 2)).all()):
            return None
    else:
        return None
    batch, seq, _ = allowed.shape
    real = allowed.any(-1)  # [B, S]: queries that see some key
    first = allowed.int().argmax(-1)  # the first key each query sees
    index = torch.arange(seq, device=mask.device)
    # Each real query sees exactly [its document's start, itself]; a document starts where a query's first key is
    # itself, and every other real query starts where the query before it does.
    implied = real[:, :, None] & (index[None, None, :] >= first[:, :, None]) & (index[None, None, :] <= index[:, None])
    starts = first == index
    continues = torch.zeros_like(starts)
    continues[:, 1:] = (first[:, 1:] == first[:, :-1]) & real[:, :-1]
    if not bool(torch.equal(implied, allowed) and (~real | starts | continues).all()):
        return None
    # per row: the (start, end) of every run of real tokens of one document, then padding stretches around them
    boundaries = (real & starts).tolist()
    real_rows = real.tolist()
    ends: list[int] = []
    for row in range(batch):
        offset, flags, begins, position = row * seq, real_rows[row], boundaries[row], 0
        while position < seq:
            stop = position + 1
            if flags[position]:
                while stop < seq and flags[stop] and not begins[stop]:
                    stop += 1
                ends.append(offset + stop)
            else:
                while stop < seq and not flags[stop] and stop - position < PAD_PIECE:
                    stop += 1
                ends.append(offset + stop)
            position = stop
    keep = None if all(all(r) for r in real_rows) else real.reshape(-1, 1, 1)
    return VarlenInfo(None, tuple(ends), True, batch * seq, keep)


def _version(t: torch.Tensor) -> int:
    try:
        return t._version  # bumps on in-place writes: a reused, rewritten mask is not a stale hit
    except RuntimeError:  # inference-mode tensors have no version counter (and cannot be written outside it)
        return -1


def varlen_info(source: torch.Tensor, kind: str) -> VarlenInfo | None:
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
    """[B, N, S, D] (HF's layout) -> [T, N, D] (TND): every position in order, or only the real tokens when
    `info.indices` says which."""
    batch, heads, seq, dim = x.shape
    flat = x.transpose(1, 2).reshape(batch * seq, heads, dim)
    return flat if info.indices is None else flat.index_select(0, info.indices)


def pad(x: torch.Tensor, info: VarlenInfo, batch: int, seq: int) -> torch.Tensor:
    """[T, N, D] -> [B, S, N, D] (HF's attention output layout); zeros at the padded positions."""
    if info.keep is not None:
        x = x * info.keep
    elif info.indices is not None:
        full = x.new_zeros(info.total, *x.shape[1:])
        x = full.index_copy(0, info.indices, x)  # out of place: differentiable w.r.t. x
    return x.reshape(batch, seq, *x.shape[1:])


def block_causal(mask, batch: int, q_len: int, kv_len: int) -> VarlenInfo | None:
    """The documents of `mask` when it is a materialised block-diagonal causal [batch, 1, S, S] mask over a call's
    [batch, S] (LLaMA-Factory's neat_packing mask, ...), read once per mask (block_causal_info); None otherwise."""
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[0] == batch
            and mask.shape[-1] == kv_len == q_len == mask.shape[-2]):
        return None
    return varlen_info(mask, "block_causal")


def boundary_ids(cu_q: torch.Tensor, cu_k: torch.Tensor | None, batch: int, seq: int,
                 device: torch.device) -> torch.Tensor | None:
    """HF's packed-sequence ids of the documents a collator's `cu_seq_lens_q` (cumulative, leading 0) describes over
    the flattened [batch, seq] tokens (read once per step); None when they do not cover exactly those tokens, let a
    document run across rows, pack nothing (one document per row), or disagree with `cu_seq_lens_k`."""
    info = varlen_info(cu_q, "cu_seqlens")
    ends = set(info.cu_seqlens)
    if (info.total != batch * seq or len(ends) <= batch  # not this call's tokens, or nothing packed
            or any(row * seq not in ends for row in range(1, batch))):  # a document across rows
        return None
    if cu_k is not None and cu_k is not cu_q and (not isinstance(cu_k, torch.Tensor)
                                                  or varlen_info(cu_k, "cu_seqlens") != info):
        return None
    return sequence_ids(info.cu_seqlens, batch, str(device))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def sequence_ids(cu_seqlens: tuple[int, ...], batch: int, device: str) -> torch.Tensor:
    """HF's packed-sequence ids ([batch, S], equal values = one document) of documents ending at `cu_seqlens` (the
    host tuple, no leading 0) over the flattened [batch, S] tokens; one tensor per layout (memoised)."""
    lengths = [end - start for start, end in zip((0, *cu_seqlens[:-1]), cu_seqlens)]
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids.reshape(batch, -1).to(device)


# A group of packed documents run as one batch of rows wastes at most this share of its positions on padding.
MAX_PADDING = 0.25


@dataclass(frozen=True)
class DocumentRows:
    """One group of packed documents laid out as right-padded rows, one document per row: `tokens` are the group's
    positions in the flattened packed batch, `index` where each goes in the flattened [rows, longest] layout, `mask`
    [rows, longest] is 1 at the real tokens (HF's 2-D attention mask for the rows)."""

    tokens: torch.Tensor
    index: torch.Tensor
    mask: torch.Tensor

    def to_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """[T, ...] packed tokens -> [rows, longest, ...] (zeros after each document); differentiable."""
        rows = flat.new_zeros(self.mask.numel(), *flat.shape[1:])
        rows = rows.index_copy(0, self.index, flat.index_select(0, self.tokens))
        return rows.reshape(*self.mask.shape, *flat.shape[1:])

    def real(self, y: torch.Tensor) -> torch.Tensor:
        """[rows, longest, ...] -> the group's tokens [n, ...], in `tokens` order; differentiable."""
        return y.reshape(-1, *y.shape[2:]).index_select(0, self.index)


@dataclass(frozen=True)
class DocumentLayout:
    """Packed documents as groups of right-padded rows (documents of similar length together, so that no group
    wastes more than MAX_PADDING of its positions), and `order`: each packed token's row in the groups' real
    outputs laid end to end."""

    groups: tuple[DocumentRows, ...]
    order: torch.Tensor

    def join(self, outputs: list[torch.Tensor], batch: int) -> torch.Tensor:
        """The groups' outputs ([rows, longest, ...] each) back into the packed [batch, S, ...]; differentiable."""
        flat = torch.cat([group.real(y) for group, y in zip(self.groups, outputs)]).index_select(0, self.order)
        return flat.reshape(batch, -1, *flat.shape[1:])


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Documents (by index) grouped longest first; a group closes when the next document would make more than
    MAX_PADDING of the group's positions (documents x its longest) padding."""
    groups: list[list[int]] = []
    total = 0
    for doc in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        group = groups[-1] if groups else None
        if group is None or (len(group) + 1) * lengths[group[0]] * (1 - MAX_PADDING) > total + lengths[doc]:
            groups.append([doc])
            total = lengths[doc]
        else:
            group.append(doc)
            total += lengths[doc]
    return groups


def document_layout(info: VarlenInfo, device: torch.device | str) -> DocumentLayout:
    """The rows layout of `info`'s sequences (each one row, grouped by length_groups), memoised per layout."""
    return _document_layout(info.cu_seqlens, str(device))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _document_layout(cu_seqlens: tuple[int, ...], device: str) -> DocumentLayout:
    starts = (0, *cu_seqlens[:-1])
    lengths = [end - start for start, end in zip(starts, cu_seqlens)]
    groups, laid = [], []
    for docs in length_groups(lengths):
        longest = lengths[docs[0]]
        tokens = torch.cat([torch.arange(starts[d], cu_seqlens[d], device=device) for d in docs])
        index = torch.cat([torch.arange(row * longest, row * longest + lengths[d], device=device)
                           for row, d in enumerate(docs)])
        mask = torch.zeros(len(docs) * longest, dtype=torch.long, device=device).index_fill(0, index, 1)
        groups.append(DocumentRows(tokens, index, mask.reshape(len(docs), longest)))
        laid.append(tokens)
    order = torch.empty(sum(lengths), dtype=torch.long, device=device)
    order[torch.cat(laid)] = torch.arange(sum(lengths), device=device)
    return DocumentLayout(tuple(groups), order)
