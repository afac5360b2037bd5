"""Which accelerator is here, and the few device-specific facts the rest of the package needs.

torch_npu is imported defensively: without the CANN toolkit it raises ImportError/OSError, and torch_npu 2.14
refuses to load beside a CUDA build of torch. Either way we warn once and carry on without it.
"""

from __future__ import annotations

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
