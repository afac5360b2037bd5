"""Asynchronous activation offload: what a decoder layer saves for backward goes to host memory during forward and
comes back, one layer ahead, during backward (`memory.offload_activations`).

Per training forward (a *pass*) and offloaded decoder layer (a *record*), inside the layer's forward:

- pack (torch.autograd.graph.saved_tensors_hooks): an offloadable saved tensor (`offloadable`: not a parameter,
  not a view, not part of a larger storage, at least `min_bytes`) is copied to a host buffer from the pool on the
  side stream, after that stream waited for the compute stream; the hook keeps a detached alias of it. A storage
  saved several times is copied once.
- free, when the next decoder layer starts: each copied storage that nothing but our alias still holds
  (torch._C._storage_Use_Count) has its device memory released (`untyped_storage().resize_(0)`); the caching
  allocator does not reuse it before the copy on the side stream is done (`Transfers.used_by`). A storage still
  held elsewhere (the rotary cos/sin every layer reads, a layer output the model keeps) stays on the device, its
  host buffer goes back to the pool and it is not copied again in this pass.
- load, in backward: when the gradient of layer j's output arrives, layer j's record (if not loaded yet) and the
  previous offloaded layer's are brought back: device memory re-allocated (`resize_`), the host copy copied into it
  on the side stream, an event recorded; the host buffers go back to the pool. unpack makes the compute stream wait
  for that event and returns the alias (loading first, if no output hook did).

The last decoder layer is never offloaded (its backward comes first). With recompute on, what a checkpointed layer
saves is its recompute inputs (the layer input), and so those are what is offloaded. On the CPU the streams and
events are stand-ins (device.Transfers), but the copies, the freeing and the restoring are the same code, so CPU
tests exercise the real logic. A forward that raises resets the pass; several passes may be outstanding (forwards
before their backwards).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..device import DEVICE_TYPES, transfers
from ..releases import compat
from .host_pool import HostBufferPool


def offloadable(t: torch.Tensor, min_bytes: int) -> bool:
    """Whether a saved tensor may be copied out: a plain strided device tensor that owns its whole (resizable)
    storage of at least `min_bytes`, and is neither a parameter nor a view. (Whether its memory may then be freed
    is decided when the next layer starts: only if nothing else holds the storage.)"""
    if isinstance(t, nn.Parameter) or type(t) is not torch.Tensor or t.layout != torch.strided:
        return False
    if t._is_view() or t.device.type not in DEVICE_TYPES:
        return False
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    return (0 < nbytes and nbytes >= min_bytes and t.storage_offset() == 0
            and t.numel() * t.element_size() == nbytes and storage.resizable())


@dataclass(eq=False)
class _Entry:
    """One offloaded storage: the alias that holds it, its size, its host copy, and how many more aliases of it
    (`_Saved.alias`) packing handed out."""

    alias: torch.Tensor
    nbytes: int
    host: torch.Tensor | None
    record: _Record
    freed: bool = False
    handles: int = 0


@dataclass(eq=False)
class _Saved:
    """What the pack hook returns for an offloaded tensor: its own detached alias (its shape and strides; the
    storage is the entry's) and the entry."""

    alias: torch.Tensor
    entry: _Entry


@dataclass(eq=False)
class _Record:
    """One layer's part of one pass."""

    layer: int
    pass_: _Pass
    entries: list[_Entry] = field(default_factory=list)
    loaded: bool = False
    h2d: Any = None


@dataclass(eq=False)
class _Pass:
    """One training forward (and its backward)."""

    records: dict[int, _Record] = field(default_factory=dict)
    by_storage: dict[int, _Entry] = field(default_factory=dict)
    shared: set[int] = field(default_factory=set)  # storages found held elsewhere: not copied again
    pending: _Record | None = None  # packed, not freed yet
    last_layer: int = -1

    def previous(self, layer: int) -> _Record | None:
        earlier = [i for i in self.records if i < layer]
        return self.records[max(earlier)] if earlier else None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage of `t` (copies between it and a host buffer move the storage as is,
    whatever `t`'s strides)."""
    return t.new_empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def _storage_used_elsewhere(entry: _Entry) -> bool:
    storage = entry.alias.untyped_storage()
    # ours: the entry's alias, one per handle, and `storage` itself
    return torch._C._storage_Use_Count(compat.storage_key(storage)) > entry.handles + 2


class ActivationOffloader:
    """The offload state of one model (see the module docstring). `trace`, when set to a list, receives
    ("pack" | "free" | "keep" | "load" | "unpack", layer) events in order, for tests.

    Counters: `offloaded_bytes` is the device memory freed and not yet restored now, `peak_offloaded_bytes` its
    high-water mark; `pools` the host-buffer pools by device type."""

    def __init__(self, min_bytes: int) -> None:
        self.min_bytes = min_bytes
        self.pools: dict[str, HostBufferPool] = {}
        self.trace: list[tuple[str, int]] | None = None
        self.offloaded_bytes = 0
        self.peak_offloaded_bytes = 0
        self._passes: weakref.WeakSet[_Pass] = weakref.WeakSet()
        self._current: weakref.ReferenceType[_Pass] | None = None

    # ------------------------------------------------------------------------------------------- bookkeeping
    def live_entries(self) -> int:
        """Offloaded storages not yet loaded back, over every pass still alive."""
        return sum(len(r.entries) for p in list(self._passes) for r in p.records.values())

    def reset(self) -> None:
        """Forget the current pass (a forward raised): host buffers back to the pool, nothing left pending."""
        current = self._current() if self._current is not None else None
        self._current = None
        if current is None:
            return
        for record in current.records.values():
            for entry in record.entries:
                self._release(entry)
                if entry.freed:
                    self.offloaded_bytes -= entry.nbytes
            record.entries.clear()
        current.records.clear()
        current.by_storage.clear()
        current.pending = None

    def _note(self, event: str, layer: int) -> None:
        if self.trace is not None:
            self.trace.append((event, layer))

    def _pool(self, device_type: str) -> HostBufferPool:
        if device_type not in self.pools:
            self.pools[device_type] = HostBufferPool(transfers(device_type))
        return self.pools[device_type]

    def _release(self, entry: _Entry) -> None:
        if entry.host is not None:
            self._pool(entry.alias.device.type).put(entry.host)
            entry.host = None

    # ------------------------------------------------------------------------------------------- forward
    def _pass_for(self, layer: int) -> _Pass:
        current = self._current() if self._current is not None else None
        if current is None or layer <= current.last_layer:  # a new forward
            current = _Pass()
            self._passes.add(current)
            self._current = weakref.ref(current)
        return current

    @contextlib.contextmanager
    def layer(self, index: int, offload: bool) -> Iterator[_Pass]:
        """Around decoder layer `index`'s training forward: frees the previous offloaded layer's copies, and with
        `offload` packs what this layer saves. Yields the pass (for `backward_reaches`)."""
        current = self._pass_for(index)
        if current.pending is not None:
            self._free(current.pending)
            current.pending = None
        current.last_layer = index
        record = _Record(index, current) if offload else None
        hooks = (torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(record, t), self._unpack)
                 if record is not None else contextlib.nullcontext())
        if record is not None:
            current.records[index] = record
        try:
            with hooks:
                yield current
        except BaseException:
            self.reset()
            raise
        current.pending = record

    def _pack(self, record: _Record, t: torch.Tensor) -> Any:
        if not offloadable(t, self.min_bytes):
            return t
        current = record.pass_
        key = compat.storage_key(t.untyped_storage())
        if key in current.shared:
            return t
        known = current.by_storage.get(key)
        if known is not None:  # the same storage saved again (maybe with another shape): copied once
            known.handles += 1
            return _Saved(t.detach(), known)
        ways = transfers(t.device.type)
        nbytes = t.untyped_storage().nbytes()
        entry = _Entry(t.detach(), nbytes, self._pool(t.device.type).get(nbytes), record, handles=1)
        side = ways.side_stream()
        side.wait_stream(ways.current_stream())
        with ways.on(side):
            entry.host.copy_(_bytes(entry.alias), non_blocking=ways.asynchronous)
        ways.used_by(entry.alias, side)
        record.entries.append(entry)
        current.by_storage[key] = entry
        self._note("pack", record.layer)
        return _Saved(t.detach(), entry)

    def _free(self, record: _Record) -> None:
        """The next layer started: release the device memory of every copied storage nothing else holds."""
        kept = []
        for entry in record.entries:
            if _storage_used_elsewhere(entry):
                record.pass_.shared.add(compat.storage_key(entry.alias.untyped_storage()))
                self._release(entry)
                self._note("keep", record.layer)
                continue
            entry.alias.untyped_storage().resize_(0)
            entry.freed = True
            kept.append(entry)
            self.offloaded_bytes += entry.nbytes
        self.peak_offloaded_bytes = max(self.peak_offloaded_bytes, self.offloaded_bytes)
        record.entries = kept
        self._note("free", record.layer)

    # ------------------------------------------------------------------------------------------- backward
    def backward_reaches(self, current: _Pass, layer: int) -> None:
        """The gradient of decoder layer `layer`'s output arrived: load its record and prefetch the previous one."""
        record = current.records.get(layer)
        if record is not None:
            self._load(record)
        previous = current.previous(layer)
        if previous is not None:
            self._load(previous)

    def _load(self, record: _Record) -> None:
        if record.loaded:
            return
        record.loaded = True
        if record is record.pass_.pending:  # backward before the next layer started (no later layer ran)
            record.pass_.pending = None
        freed = [e for e in record.entries if e.freed]
        if freed:
            ways = transfers(freed[0].alias.device.type)
            side = ways.side_stream()
            for entry in freed:
                entry.alias.untyped_storage().resize_(entry.nbytes)
            side.wait_stream(ways.current_stream())  # the new allocations are the compute stream's
            with ways.on(side):
                for entry in freed:
                    _bytes(entry.alias).copy_(entry.host, non_blocking=ways.asynchronous)
                    ways.used_by(entry.alias, side)  # not reused before the copy lands, even if never unpacked
            record.h2d = ways.event()
            record.h2d.record(side)
            self.offloaded_bytes -= sum(e.nbytes for e in freed)
        for entry in record.entries:
            self._release(entry)
            entry.freed = False
        record.entries = []  # the aliases now live as long as autograd holds them, as without offload
        self._note("load", record.layer)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        record = packed.entry.record
        self.backward_reaches(record.pass_, record.layer)
        if record.h2d is not None:
            transfers(packed.alias.device.type).current_stream().wait_event(record.h2d)
        self._note("unpack", record.layer)
        return packed.alias
