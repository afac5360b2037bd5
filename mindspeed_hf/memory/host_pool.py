"""A pool of host buffers for activation offload, reused from one step to the next.

Pinned host memory is slow to allocate (and the host allocator caches it anyway), so buffers are kept once
allocated: `get(nbytes)` hands out a free buffer of exactly that size, allocating only when none is free, and
`put` returns one. A training step offloads the same sizes every time, so from the second step on nothing is
allocated. Copies into and out of a buffer are all issued on one side stream (memory/offload.py), in order, so a
buffer can be returned as soon as its last copy has been issued.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ..device import Transfers


class HostBufferPool:
    """Host buffers (uint8 tensors, pinned on accelerators) by size. `allocated` / `reused` count `get` calls that
    allocated a new buffer / handed out a free one; `held_bytes` is the host memory the pool owns."""

    def __init__(self, transfers: Transfers) -> None:
        self.transfers = transfers
        self._free: defaultdict[int, list[torch.Tensor]] = defaultdict(list)
        self.allocated = 0
        self.reused = 0
        self.held_bytes = 0

    def get(self, nbytes: int) -> torch.Tensor:
        """A buffer of `nbytes` bytes, free for the caller until it is `put` back."""
        free = self._free[nbytes]
        if free:
            self.reused += 1
            return free.pop()
        self.allocated += 1
        self.held_bytes += nbytes
        return self.transfers.host_buffer(nbytes)

    def put(self, buffer: torch.Tensor) -> None:
        """Give `buffer` back (after its last copy has been issued on the side stream)."""
        self._free[buffer.numel()].append(buffer)

    def free_buffers(self) -> int:
        """How many buffers are back in the pool."""
        return sum(len(v) for v in self._free.values())

    def clear(self) -> None:
        """Drop every free buffer (their host memory goes back to the allocator)."""
        for nbytes, buffers in self._free.items():
            self.held_bytes -= nbytes * len(buffers)
        self._free.clear()
