"""Which accelerator is here, and the few device-specific facts the rest of the package needs.

torch_npu is imported defensively: without the CANN toolkit it raises ImportError/OSError, and torch_npu 2.14
refuses to load beside a CUDA build of torch. Either way we warn once and carry on without it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import resource
import sys
from types import ModuleType

import torch

logger = logging.getLogger("mindspeed_hf")

DEVICE_TYPES = ("npu", "cuda", "cpu")
DIST_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


@functools.cache
def import_torch_npu() -> ModuleType | None:
    """Import torch_npu once; return None (with one warning) when it is absent or cannot load here."""
    try:
        return importlib.import_module("torch_npu")
    except ModuleNotFoundError:
        return None
    except (ImportError, OSError, RuntimeError) as err:  # no CANN, or a CUDA build of torch
        logger.warning("mindspeed_hf: torch_npu is installed but cannot be loaded here (%s); NPU kernels are off.", err)
        return None


def npu_available() -> bool:
    """True only when torch_npu loads AND an NPU device is visible (torch.npu exists and reports one)."""
    if import_torch_npu() is None:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def detect_device_type() -> str:
    """The accelerator of this process: "npu", "cuda" or "cpu"."""
    if npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def model_device(model: torch.nn.Module) -> torch.device:
    """The device `model` runs on (a model on meta: this process's accelerator, where it will be materialised)."""
    param = next(model.parameters(), None)
    if param is None:
        return torch.device("cpu")
    if param.device.type == "meta":
        return torch.device(detect_device_type())
    return param.device


def dist_backend(device_type: str) -> str:
    """The torch.distributed backend for a device type (hccl, nccl or gloo)."""
    if device_type not in DIST_BACKENDS:
        raise ValueError(f"unsupported device type {device_type!r}; valid choices: {sorted(DIST_BACKENDS)}")
    return DIST_BACKENDS[device_type]


def device_module(device_type: str) -> ModuleType | None:
    """torch.npu / torch.cuda for an accelerator, None for the CPU."""
    return getattr(torch, device_type, None) if device_type in ("npu", "cuda") else None


def reset_peak_memory(device_type: str) -> None:
    """Start a fresh peak-memory window (accelerators only; the CPU peak is the process's high-water mark)."""
    module = device_module(device_type)
    if module is not None:
        module.reset_peak_memory_stats()


def peak_memory_bytes(device_type: str) -> int:
    """Peak memory of this process: allocator peak on an accelerator, resident-set high-water mark on the CPU."""
    module = device_module(device_type)
    if module is not None:
        return int(module.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


# ---------------------------------------------------------------------------------------------- host transfers
class HostStream:
    """The CPU's stand-in for a device stream: work runs when it is issued, so waiting is already done."""

    def wait_stream(self, other: object) -> None:
        """Nothing to wait for: CPU copies have finished when they return."""

    def wait_event(self, event: object) -> None:
        """Nothing to wait for (see wait_stream)."""

    def synchronize(self) -> None:
        """Nothing pending."""


class HostEvent:
    """The CPU's stand-in for a device event: recorded means done."""

    def record(self, stream: object = None) -> None:
        """Mark the point (already reached on the CPU)."""

    def synchronize(self) -> None:
        """Already reached."""

    def query(self) -> bool:
        return True


class Transfers:
    """What copies between device and host memory need on one device type: a side stream, events, host buffers.

    On NPU / CUDA these are the real torch.npu / torch.cuda streams and events and pinned host memory, so copies
    issued on the side stream overlap the compute stream. On the CPU (`module` None) the streams and events are
    HostStream / HostEvent, whose work is done when issued; copies still go into separate host buffers, so code
    written against this class runs the same logic on the CPU."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.module = device_module(device_type)
        self._side: object | None = None

    @property
    def asynchronous(self) -> bool:
        """True where copies run on a real side stream (NPU / CUDA)."""
        return self.module is not None

    def current_stream(self) -> object:
        return self.module.current_stream() if self.module is not None else HostStream()

    def side_stream(self) -> object:
        """The one side stream of this device type (created on first use)."""
        if self._side is None:
            self._side = self.module.Stream() if self.module is not None else HostStream()
        return self._side

    def on(self, stream: object) -> contextlib.AbstractContextManager:
        """Context in which work is issued on `stream`."""
        return self.module.stream(stream) if self.module is not None else contextlib.nullcontext()

    def event(self) -> object:
        return self.module.Event() if self.module is not None else HostEvent()

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of host memory (a uint8 tensor): pinned on an accelerator, so copies can be asynchronous."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.module is not None)

    def used_by(self, tensor: torch.Tensor, stream: object) -> None:
        """Tell the caching allocator that `stream` uses `tensor` (its memory is not reused before that work
        completes, even once freed); nothing to do on the CPU."""
        if self.module is not None:
            tensor.record_stream(stream)


@functools.cache
def transfers(device_type: str) -> Transfers:
    """The Transfers of a device type (one side stream per process and device type)."""
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"unsupported device type {device_type!r}; valid choices: {', '.join(DEVICE_TYPES)}")
    return Transfers(device_type)
