"""Kernel registry: one implementation per (op, backend), chosen from the tensors' device once per (op, requested
backend, device) and then looked up in a dict (the choice sits on the hot path of every patched call).

`MINDSPEED_HF_BACKEND=auto|torch|npu|cuda` overrides the choice: `auto` follows the device; a forced `npu` runs
the torch_npu path even on CPU tensors (how the NPU path is tested with a stand-in module). A backend whose
library is missing (liger-kernel on CUDA, say) falls back to the pure-torch reference, and `implementation()`
says so, so that `report()` shows what really runs.
"""

from __future__ import annotations

import contextvars
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import BACKEND_CHOICES  # declared with the settings (config imports no torch)
from ..device import import_torch_npu

_DEVICE_TO_BACKEND = {"npu": "npu", "cuda": "cuda"}


@dataclass(frozen=True)
class Kernel:
    """One implementation of an op for one backend."""

    op: str
    backend: str
    name: str
    fn: Callable
    available: Callable[[], bool]


_KERNELS: dict[str, dict[str, Kernel]] = {}
# (op, requested backend, device as given) -> the kernel chosen for it; emptied when a kernel is registered.
_CHOSEN: dict[tuple[str, str, str | torch.device], Kernel] = {}
_DEVICE_BACKENDS: dict[str | torch.device, str] = {}  # device as given -> its own backend (resolve_backend)
_backend = {"requested": None}  # set by set_backend(); None = read MINDSPEED_HF_BACKEND on first use
# The backend of the model that is running now (its own config's), set around its forward by patches/scope.py.
_running_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar("mindspeed_hf_backend", default=None)
# What ran: the counter of the model that is running now (op -> executions of our kernels), set by patches/scope.py.
_ran: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar("mindspeed_hf_ran", default=None)
# The running backends while torch.compile traces a model's forward (use_backend).
_traced_backends: list[str | None] = []
# Registry ops counted under the name report() uses for them.
_REPORTED_AS = {"swiglu_packed": "swiglu", "context_block_forward": "attention", "dit_attention": "attention",
                "dit_rope": "rope", "dit_rms_norm": "rms_norm"}


def _always() -> bool:
    return True


def _npu_importable() -> bool:
    return import_torch_npu() is not None


@functools.cache
def liger_available() -> bool:
    """liger-kernel importable (it needs triton, so only on CUDA machines in practice)."""
    try:
        import liger_kernel.ops  # noqa: F401
    except Exception:  # ImportError, or triton failing to find a GPU driver
        return False
    return True


_DEFAULT_AVAILABILITY = {"torch": _always, "npu": _npu_importable, "cuda": liger_available}


def register(op: str, backend: str, name: str | None = None, available: Callable[[], bool] | None = None):
    """Decorator: register `fn` as the `backend` implementation of `op`."""
    if backend not in BACKEND_CHOICES[1:]:
        raise ValueError(f"backend {backend!r} is not one of {BACKEND_CHOICES[1:]}")

    def decorate(fn: Callable) -> Callable:
        check = available or _DEFAULT_AVAILABILITY[backend]
        _KERNELS.setdefault(op, {})[backend] = Kernel(op, backend, name or f"{backend}:{fn.__name__}", fn, check)
        _CHOSEN.clear()
        return fn

    return decorate


def validate_backend_name(name: str, setting: str = "MINDSPEED_HF_BACKEND") -> str:
    if name not in BACKEND_CHOICES:
        raise ValueError(f"{setting}={name!r} is not valid; choose one of {', '.join(BACKEND_CHOICES)}")
    if name == "npu" and not _npu_importable():
        raise ValueError(f"{setting}=npu but torch_npu cannot be imported here; choose one of auto, torch, cuda")
    return name


def set_backend(name: str | None, setting: str = "backend") -> None:
    """Force a backend (or None to re-read MINDSPEED_HF_BACKEND). Validated before anything runs; errors name
    `setting`, where the value came from."""
    _backend["requested"] = None if name is None else validate_backend_name(name, setting)


def use_backend(name: str | None) -> contextvars.Token | None:
    """Make `name` (validated by the caller) the backend of the code that runs until `reset_backend(token)`;
    None: the process one. While torch.compile traces (it cannot trace a ContextVar) the choice goes on a plain
    stack that the trace reads: it is made once, when the graph is built."""
    if torch.compiler.is_compiling():
        _traced_backends.append(name)
        return None
    return _running_backend.set(name)


def reset_backend(token: contextvars.Token | None) -> None:
    if token is None:
        _traced_backends.pop()
    else:
        _running_backend.reset(token)


def requested_backend() -> str:
    """The running model's backend, else the process one (set_backend, or MINDSPEED_HF_BACKEND)."""
    running = (_traced_backends[-1] if _traced_backends else None) if torch.compiler.is_compiling() \
        else _running_backend.get()
    if running is not None:
        return running
    if _backend["requested"] is None:
        _backend["requested"] = validate_backend_name(os.environ.get("MINDSPEED_HF_BACKEND", "auto").lower())
    return _backend["requested"]


def resolve_backend(device: torch.device | str) -> str:
    """The backend that kernels on `device` use: the forced one, or the device's own under `auto`."""
    return _backend_for(requested_backend(), device)


def _backend_for(requested: str, device: torch.device | str) -> str:
    """`requested`, or under `auto` the backend of `device`'s type (npu, cuda; torch for any other), found once per
    device."""
    if requested != "auto":
        return requested
    backend = _DEVICE_BACKENDS.get(device)
    if backend is None:
        backend = _DEVICE_BACKENDS[device] = _DEVICE_TO_BACKEND.get(torch.device(device).type, "torch")
    return backend


def _choose(op: str, requested: str, device: torch.device | str) -> Kernel:
    kernels = _KERNELS[op]
    kernel = kernels.get(_backend_for(requested, device))
    if kernel is None or not kernel.available():
        kernel = kernels["torch"]
    return kernel


def _chosen(op: str, requested: str, device: torch.device | str) -> Kernel:
    """The kernel for (op, requested backend, device), chosen once and kept (availability checked then). Kept by the
    device as given (a torch.device hashes in C, where reading its `.type` builds a string every call)."""
    key = (op, requested, device)
    kernel = _CHOSEN.get(key)
    if kernel is None:
        kernel = _CHOSEN[key] = _choose(op, requested, device)
    return kernel


def select(op: str, device: torch.device | str) -> Kernel:
    """The kernel that runs `op` for tensors on `device` (the torch reference when the backend has none). Chosen
    once per (op, requested backend, device)."""
    return _chosen(op, requested_backend(), device)


def has_own_kernel(op: str, device: torch.device | str) -> bool:
    """Whether `op` runs a backend's own kernel for tensors on `device`, not the torch reference (which runs on the
    torch backend, and on a device backend with no kernel for `op` or without its library)."""
    return select(op, device).backend != "torch"


def run(op: str, device: torch.device | str) -> Callable:
    """The function that runs `op` for tensors on `device` (as `select`), counted as one execution on the running
    model's counter (report()["ran"]: what really ran, not what was patched). The hot path of every patched call:
    one compile check, two context-variable reads, one dict look-up."""
    if torch.compiler.is_compiling():  # a compiled graph runs no Python to count
        return select(op, device).fn
    # requested_backend() without its compile check (done above) and its first-use environment read
    kernel = _chosen(op, _running_backend.get() or _backend["requested"] or requested_backend(), device)
    counts = _ran.get()
    if counts is not None:
        name = _REPORTED_AS.get(op, op)
        counts[name] = counts.get(name, 0) + 1
    return kernel.fn


FALLBACK = "fallback:"  # counter key prefix: calls a device kernel handed to the torch path (FALLBACK + op)


def fell_back(op: str) -> None:
    """The running call of `op`, counted by run() as its kernel's, went to the torch path instead: counted as a
    fallback of `op` (report()["fallbacks"]), not in report()["ran"]."""
    counts = _ran.get()
    if counts is not None:
        name = _REPORTED_AS.get(op, op)
        counts[name] = counts.get(name, 0) - 1
        counts[FALLBACK + name] = counts.get(FALLBACK + name, 0) + 1


def split_fallbacks(counts: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """A model's counter as (ran, fallbacks): executions of our kernels per op, and calls that fell back per op."""
    ran = {op: n for op, n in counts.items() if not op.startswith(FALLBACK)}
    fallbacks = {op[len(FALLBACK):]: n for op, n in counts.items() if op.startswith(FALLBACK)}
    return ran, fallbacks


def count_into(counts: dict[str, int] | None) -> contextvars.Token | None:
    """Count the kernels that run until `stop_counting(token)` into `counts` (a model's own counter); nothing while
    torch.compile traces."""
    return None if torch.compiler.is_compiling() else _ran.set(counts)


def counter() -> dict[str, int] | None:
    """The counter kernels are counted into now (count_into), or None."""
    return _ran.get()


def stop_counting(token: contextvars.Token | None) -> None:
    if token is not None:
        _ran.reset(token)


def implementation(op: str, device: torch.device | str) -> str:
    """Name of the implementation that `op` runs on `device`, e.g. "npu:npu_rms_norm" or "torch"."""
    return select(op, device).name


def registered_ops() -> list[str]:
    return sorted(_KERNELS)
