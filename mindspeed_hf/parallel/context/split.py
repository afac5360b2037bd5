"""The sequence splitter for context parallelism: which tokens each cp rank holds, and the way back.

A [B, S] batch is prepared once on every rank of the cp group (they all see the same global batch):
1. labels are shifted GLOBALLY first (`shift_labels[t] = labels[t + 1]`, the last one ignored), so the token at
   a slice's end still predicts the first token of the next slice;
2. the sequence is padded at the tail to a multiple of cp (2 * cp for zigzag): pad tokens, ignored labels, and
   positions that keep counting;
3. each rank takes its tokens (`shard_indices`): contiguous (rank r: the r-th of cp equal slices) or zigzag
   (2 * cp chunks, rank r: chunks r and 2 * cp - 1 - r); with Ulysses inside a ring (hybrid, cp = ring x U,
   rank = ring_rank * U + ulysses_rank) the ring piece of ring_rank is cut into U contiguous parts;
4. position_ids stay global (RoPE is right on every rank); packed rows (positions that restart) also get
   `segment_ids`, one id per document, -1 on the tail padding, so that attention keeps document boundaries
   even where a document crosses a rank boundary.
`unshard` / `gather_sequence` put per-rank pieces back in global order (tests, outputs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

IGNORE_INDEX = -100
PAD_SEGMENT = -1
MASKED_SEGMENT = -2  # tokens an attention mask hides (left padding): only each other see them


def _check_sizes(cp: int, ulysses: int) -> None:
    if cp < 1 or ulysses < 1 or cp % ulysses:
        raise ValueError(f"context parallel sizes: cp={cp} must be a positive multiple of cp_ulysses={ulysses}")


def padded_length(seq_len: int, cp: int, zigzag: bool = False) -> int:
    """The length the sequence is padded to: a multiple of cp, of 2 * cp for zigzag."""
    _check_sizes(cp, 1)
    unit = 2 * cp if zigzag else cp
    if seq_len < unit:
        raise ValueError(f"sequence length {seq_len} is shorter than {'2 * ' if zigzag else ''}cp={unit}: every "
                         f"rank needs at least one token{' per chunk' if zigzag else ''}; lower parallel.cp")
    return -(-seq_len // unit) * unit


def shard_indices(padded_len: int, cp: int, rank: int, zigzag: bool = False, ulysses: int = 1) -> torch.Tensor:
    """Global token positions (ascending within each chunk) held by `rank` of a cp group, as a LongTensor."""
    _check_sizes(cp, ulysses)
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside the cp group of size {cp}")
    ring, ring_rank, u_rank = cp // ulysses, rank // ulysses, rank % ulysses
    if padded_len % (2 * cp if zigzag else cp):
        raise ValueError(f"length {padded_len} is not padded to a multiple of {'2 * ' if zigzag else ''}cp; "
                         f"use padded_length()")
    if zigzag:
        chunk = padded_len // (2 * ring)
        first = torch.arange(ring_rank * chunk, (ring_rank + 1) * chunk)
        second = torch.arange((2 * ring - 1 - ring_rank) * chunk, (2 * ring - ring_rank) * chunk)
        piece = torch.cat([first, second])
    else:
        size = padded_len // ring
        piece = torch.arange(ring_rank * size, (ring_rank + 1) * size)
    return piece.chunk(ulysses)[u_rank]


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """[B, S] -> [B, S]: the label each position predicts (HF's causal-LM shift), the last one ignored."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] document ids of a packed row: a new document wherever the position does not follow the previous
    one (HF's packed-sequence rule)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.long().cumsum(dim=1) - 1


def _pad_tail(x: torch.Tensor, length: int, value) -> torch.Tensor:
    extra = length - x.shape[1]
    if extra == 0:
        return x
    return torch.cat([x, x.new_full((x.shape[0], extra, *x.shape[2:]), value)], dim=1)


def _positions(position_ids: torch.Tensor | None, batch: int, seq: int, length: int, device) -> torch.Tensor:
    if position_ids is None:
        return torch.arange(length, device=device).expand(batch, length)
    if tuple(position_ids.shape) != (batch, seq):
        raise ValueError(f"position_ids must be [batch, seq]={[batch, seq]}, got {list(position_ids.shape)}")
    tail = position_ids[:, -1:] + torch.arange(1, length - seq + 1, device=position_ids.device)
    return torch.cat([position_ids, tail], dim=1)


def split_batch(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    cp: int,
    rank: int,
    zigzag: bool = False,
    ulysses: int = 1,
    pad_token_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
    with_segments: bool | None = None,
    attention_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's share of a global [B, S] batch: `input_ids`, `shift_labels` (when labels are given),
    global `position_ids`, and `segment_ids` when the rows are packed (or `with_segments=True`, or a padding
    `attention_mask` [B, S] is given: its masked tokens then form a segment of their own, which no real token
    sees); None otherwise. The tail padding is invisible to real tokens under causal attention; pass
    `with_segments=True` for bidirectional attention (the padding then gets its own segment)."""
    batch, seq = input_ids.shape
    length = padded_length(seq, cp, zigzag)
    if labels is not None and tuple(labels.shape) != (batch, seq):
        raise ValueError(f"labels must be [batch, seq]={[batch, seq]}, got {list(labels.shape)}")
    positions = _positions(position_ids, batch, seq, length, input_ids.device)
    segments = segment_ids(positions[:, :seq])
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (batch, seq):
            raise ValueError(f"attention_mask must be [batch, seq]={[batch, seq]}, got {list(attention_mask.shape)}")
        segments = segments.masked_fill(attention_mask.to(segments.device) == 0, MASKED_SEGMENT)
        with_segments = True
    if with_segments is None:
        with_segments = bool((segments[:, -1] > 0).any())
    idx = shard_indices(length, cp, rank, zigzag, ulysses).to(input_ids.device)
    out: dict[str, torch.Tensor] = {
        "input_ids": _pad_tail(input_ids, length, pad_token_id)[:, idx],
        "position_ids": positions[:, idx],
        "segment_ids": _pad_tail(segments, length, PAD_SEGMENT)[:, idx] if with_segments else None,
    }
    if labels is not None:
        out["shift_labels"] = _pad_tail(shift_labels(labels, ignore_index), length, ignore_index)[:, idx]
    return out


def unshard(parts: list[torch.Tensor], seq_len: int, *, zigzag: bool = False, ulysses: int = 1,
            dim: int = 1) -> torch.Tensor:
    """Per-rank pieces (rank order) -> the global tensor along `dim`, padding removed (length `seq_len`)."""
    cp = len(parts)
    length = sum(p.shape[dim] for p in parts)
    full = parts[0].new_empty(*parts[0].shape[:dim], length, *parts[0].shape[dim + 1:])
    for rank, part in enumerate(parts):
        full.index_copy_(dim, shard_indices(length, cp, rank, zigzag, ulysses).to(part.device), part)
    return full.narrow(dim, 0, seq_len)


def gather_sequence(x: torch.Tensor, group, seq_len: int, *, zigzag: bool = False, ulysses: int = 1,
                    dim: int = 1) -> torch.Tensor:
    """All-gather every rank's piece of the cp group and return the global tensor (not differentiable)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return unshard(parts, seq_len, zigzag=zigzag, ulysses=ulysses, dim=dim)
