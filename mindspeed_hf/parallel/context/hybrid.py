"""Context attention: Ulysses inside, ring across (either may be absent), on this rank's sequence slice.

cp = ring x U ranks laid out as a DeviceMesh ("ring", "ulysses"), Ulysses innermost; split.py's `ulysses=U`
layout gives rank (ring r, ulysses j) the j-th contiguous part of ring piece r (contiguous or zigzag). The
all-to-all gathers each Ulysses group's ring piece with Nq / U heads, the ring runs over the ring group on that
piece (or, without a ring, the device block kernel runs on it), and the all-to-all returns this rank's slice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .ring import local_attention, ring_attention
from .ulysses import gather_sequence_ids, ulysses_attention


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def context_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    ring_group: dist.ProcessGroup | None = None,
    ulysses_group: dist.ProcessGroup | None = None,
    segment_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **pattern: Any,
) -> torch.Tensor:
    """Attention of this rank's slice (q [B, Nq, S_local, D], k / v [B, Nkv, S_local, D]) over the whole cp
    group's sequence; returns [B, Nq, S_local, Dv]. `segment_ids` / `position_ids` [B, S_local]: packed-document
    ids and global positions (gathered over the Ulysses group here); `pattern`: ring_attention's causal, scale,
    zigzag and sliding_window."""

    def inner(q, k, v, segs=segment_ids, pos=position_ids):
        if _size(ring_group) == 1:  # one rank: no layout to follow
            local = {name: val for name, val in pattern.items() if name != "zigzag"}
            return local_attention(q, k, v, segment_ids=segs, position_ids=pos, **local)
        return ring_attention(q, k, v, ring_group, segment_ids=segs, position_ids=pos, **pattern)

    if _size(ulysses_group) == 1:
        return inner(query, key, value)
    if not pattern.get("sliding_window"):
        position_ids = None  # only the window reads positions
    segs, pos = (None if ids is None else gather_sequence_ids(ids, ulysses_group)
                 for ids in (segment_ids, position_ids))
    return ulysses_attention(query, key, value, ulysses_group, lambda q, k, v: inner(q, k, v, segs, pos))
