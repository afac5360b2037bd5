"""Exact tensor memory on the CPU: the analogue of an accelerator allocator's peak, without the noise of the
process's resident set (allocator fragmentation, Python's own objects, imported code).

    with TensorPeak() as measured:
        one_training_step()
    measured.bytes  # live at its start + the largest amount allocated and not yet freed at any point inside

The region's allocations are torch.profiler's memory events (profile_memory=True: every CPU allocation and free of
a tensor, in order); what was live at its start is the distinct tensor storages reachable from Python then
(parameters, gradients, optimizer state, caches). Deterministic: the same code gives the same bytes on every run,
so a ratio of 1.0000x means equal. The profiler slows the region down: time another one.
"""

from __future__ import annotations

import gc
from typing import Any

import torch


def live_tensor_bytes() -> int:
    """Bytes of the distinct CPU tensor storages reachable from Python now."""
    seen: set[int] = set()
    total = 0
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":  # no fake tensors
            storage = obj.untyped_storage()
            pointer = storage.data_ptr()
            if pointer and pointer not in seen:
                seen.add(pointer)
                total += storage.nbytes()
    return total


def peak_above_start(events: Any) -> int:
    """The largest sum of allocations minus frees at any point of a profiled region (its memory events in time
    order): how far above what was live at its start the region's tensor memory went."""
    live = peak = 0
    for event in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


class TensorPeak:
    """Context manager measuring the CPU tensor memory peak of its body (`bytes`, after it exits)."""

    def __enter__(self) -> TensorPeak:
        self.start = live_tensor_bytes()
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._profiler.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._profiler.stop()
        self.bytes = self.start + peak_above_start(self._profiler.profiler.kineto_results.events())
