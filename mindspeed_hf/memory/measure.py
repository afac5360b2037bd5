"""What a forward leaves in memory for its backward, measured by mechanism rather than by timing or by the allocator
(which CPUs do not report): for tests, benchmarks and memory reports.

- `saved_bytes`: the bytes autograd saves for backward, counted with torch.autograd.graph.saved_tensors_hooks
  (distinct storages, parameters excluded). Under non-reentrant checkpointing the region's own saves are not
  made at all, and the inputs checkpoint keeps for the recomputation are not seen by these hooks.
- `alive_bytes`: the bytes of every storage the forward created that is still alive when it returns (saved
  tensors, checkpoint inputs, outputs): the forward's share of the step's peak, parameters excluded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..releases import compat


@dataclass(frozen=True)
class ForwardMemory:
    """What one forward keeps for its backward (see the module docstring)."""

    saved_bytes: int
    saved_tensors: int
    alive_bytes: int


class _Created(TorchDispatchMode):
    """Weak references to the storages that ops create while active."""

    def __init__(self, exclude: set[int]) -> None:
        super().__init__()
        self.exclude = exclude
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                known = self.storages.get(compat.storage_key(storage))
                if compat.storage_key(storage) not in self.exclude and (known is None or known[0].expired()):
                    self.storages[compat.storage_key(storage)] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def alive_bytes(self) -> int:
        return sum(n for ref, n in self.storages.values() if not ref.expired())


class SavedStorages:
    """The distinct storages autograd saves for backward while `hooks()` is active, `model`'s parameters and
    buffers excluded: `nbytes` and `count`."""

    def __init__(self, model: nn.Module) -> None:
        self.exclude = {compat.storage_key(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}
        self.saved: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if compat.storage_key(storage) not in self.exclude:
            self.saved[compat.storage_key(storage)] = storage.nbytes()
        return t

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    @property
    def nbytes(self) -> int:
        return sum(self.saved.values())

    @property
    def count(self) -> int:
        return len(self.saved)


def measure_forward(model: nn.Module, forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, ForwardMemory]:
    """Run `forward()` (returns the loss) and measure what it keeps for backward; returns (loss, ForwardMemory).
    Call `loss.backward()` afterwards as usual."""
    saved = SavedStorages(model)
    with _Created(saved.exclude) as created, saved.hooks():
        loss = forward()
    return loss, ForwardMemory(saved.nbytes, saved.count, created.alive_bytes())
