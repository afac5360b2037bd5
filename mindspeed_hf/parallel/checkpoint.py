"""Checkpoints for FSDP2 models: consolidated HF export and resumable sharded (DCP) checkpoints.

* :func:`save_hf_consolidated` gathers the full weights to rank 0's host memory and writes a
  directory ``from_pretrained`` loads (for a PEFT model: the adapter only).
* :func:`save_sharded` / :func:`load_sharded` write and read model + optimizer shards with
  ``torch.distributed.checkpoint`` plus a per-rank ``extra_state`` (step, RNG, scheduler...).
  A save goes to ``<dir>.tmp`` first; once every rank is done, rank 0 renames it into place and
  then writes a ``COMPLETE`` marker, so a crash never leaves a directory that looks finished.
  Loaders (and :func:`latest_complete_checkpoint`) ignore directories without the marker.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .fsdp import reshard_model

__all__ = [
    "COMPLETE_MARKER",
    "capture_rng_state",
    "is_complete_checkpoint",
    "latest_complete_checkpoint",
    "load_model_shards",
    "load_optimizer_shards",
    "load_sharded",
    "mark_complete",
    "restore_rng_state",
    "save_hf_consolidated",
    "save_model_shards",
    "save_optimizer_shards",
    "save_sharded",
    "unmark",
]

COMPLETE_MARKER = "COMPLETE"
STAGING_SUFFIX = ".tmp"
_EXTRA = "extra_state_rank{}.pt"


def _dcp():
    """torch.distributed.checkpoint, imported where a checkpoint is written or read: importing it pulls in
    torch.distributed.elastic and the FSDP1 state-dict code, about half a second that `import mindspeed_hf` and a
    run that never checkpoints should not pay."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _state_dict_api():
    """torch.distributed.checkpoint.state_dict (see _dcp: imported where used)."""
    import torch.distributed.checkpoint.state_dict as api

    return api


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _distributed_by_transformers(model: nn.Module) -> bool:
    """A model transformers sharded itself (``from_pretrained(..., distributed_config=...)``, e.g. its own expert
    parallelism, adopted by parallelize): transformers gathers and writes it."""
    return getattr(getattr(model, "config", None), "distributed_config", None) is not None and not _is_peft(model)


def save_hf_consolidated(
    model: nn.Module,
    output_dir: str,
    rank: int | None = None,
    **save_pretrained_kwargs: Any,
) -> dict[str, torch.Tensor] | None:
    """Gather the full state dict to rank 0 (CPU) and ``save_pretrained`` it there.

    Collective: every rank must call it. For a PEFT model only the trainable (adapter) tensors are
    gathered and PEFT's ``save_pretrained`` writes the adapter. Returns the gathered state dict on
    rank 0, None elsewhere.
    """
    rank = _rank() if rank is None else rank
    if _distributed_by_transformers(model):  # its save_pretrained is collective: gathers on all, rank 0 writes
        model.save_pretrained(output_dir, **save_pretrained_kwargs)
        _barrier()
        return None
    reshard_model(model)
    peft = _is_peft(model)
    options = _state_dict_api().StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=peft)
    state = _state_dict_api().get_model_state_dict(model, options=options)
    if rank == 0:
        os.makedirs(output_dir, exist_ok=True)
        # save_pretrained consumes (empties) the dict it is given: hand it a shallow copy
        model.save_pretrained(output_dir, state_dict=dict(state), **save_pretrained_kwargs)
    _barrier()
    return state if rank == 0 else None


# ---- sharded (resumable) checkpoints --------------------------------------------------------
def mark_complete(path: str, **info: Any) -> None:
    """Write the COMPLETE marker into ``path`` (durably). Call once every rank has finished writing.

    The marker appears whole or not at all: written under another name, fsync'ed, then renamed (a process killed
    while writing it leaves no marker, never an empty one that reads as "complete")."""
    marker = os.path.join(path, COMPLETE_MARKER)
    partial = marker + STAGING_SUFFIX
    with open(partial, "w") as f:
        json.dump({"world_size": dist.get_world_size() if dist.is_initialized() else 1, "time": time.time(),
                   **info}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, marker)
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def unmark(path: str) -> None:
    """Remove the COMPLETE marker of ``path`` (before it is written over), and a marker write a kill cut short."""
    marker = os.path.join(path, COMPLETE_MARKER)
    for name in (marker, marker + STAGING_SUFFIX):
        if os.path.exists(name):
            os.remove(name)


def save_model_shards(model: nn.Module, path: str) -> None:
    """This rank's model shards (DCP) into directory ``path`` (collective)."""
    _dcp().save({"model": _state_dict_api().get_model_state_dict(reshard_model(model))}, checkpoint_id=path)


def load_model_shards(model: nn.Module, path: str) -> None:
    """Read model shards written by :func:`save_model_shards` into the sharded ``model`` (collective; the mesh
    may differ from the one that wrote them)."""
    state = {"model": _state_dict_api().get_model_state_dict(reshard_model(model))}
    _dcp().load(state, checkpoint_id=path)
    _state_dict_api().set_model_state_dict(model, state["model"])


def save_optimizer_shards(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """This rank's optimizer state shards (DCP) into directory ``path`` (collective)."""
    get_optimizer_state_dict = _state_dict_api().get_optimizer_state_dict

    _dcp().save({"optim": get_optimizer_state_dict(reshard_model(model), optimizer)}, checkpoint_id=path)


def load_optimizer_shards(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Read optimizer shards written by :func:`save_optimizer_shards` (collective)."""
    api = _state_dict_api()
    get_optimizer_state_dict, set_optimizer_state_dict = api.get_optimizer_state_dict, api.set_optimizer_state_dict

    state = {"optim": get_optimizer_state_dict(reshard_model(model), optimizer)}
    _dcp().load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, optimizer, state["optim"])


def is_complete_checkpoint(path: str) -> bool:
    """True when ``path`` is a finished :func:`save_sharded` directory (has the marker)."""
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def latest_complete_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint directory under ``root`` (None if there is none).

    Newest = largest trailing number in the directory name (``checkpoint-200``, ``step_3``),
    modification time for names without one. Staging and unmarked directories are skipped.
    """
    if not os.path.isdir(root):
        return None
    found: list[tuple[int, float, str]] = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.endswith(STAGING_SUFFIX) or not os.path.isdir(path):
            continue
        if not is_complete_checkpoint(path):
            continue
        m = re.search(r"(\d+)$", name)
        found.append((int(m.group(1)) if m else -1, os.path.getmtime(path), path))
    return max(found)[2] if found else None


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    reshard_model(model)
    if optimizer is None:
        return {"model": _state_dict_api().get_model_state_dict(model)}
    msd, osd = _state_dict_api().get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def save_sharded(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra_state: dict[str, Any] | None,
    ckpt_dir: str,
) -> str:
    """Write model + optimizer shards (DCP) and this rank's ``extra_state`` to ``ckpt_dir``.

    Collective. Writes into ``ckpt_dir + ".tmp"``, barriers, then rank 0 replaces ``ckpt_dir``
    with it and writes the ``COMPLETE`` marker. ``extra_state`` is saved per rank with
    ``torch.save`` (so per-rank RNG states survive). Returns ``ckpt_dir``. All ranks must see
    the same file system (rank 0 renames the staging directory).
    """
    ckpt_dir = os.path.normpath(ckpt_dir)
    staging = ckpt_dir + STAGING_SUFFIX
    rank = _rank()
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    _barrier()
    os.makedirs(staging, exist_ok=True)
    _dcp().save(_state(model, optimizer), checkpoint_id=staging)
    torch.save(extra_state or {}, os.path.join(staging, _EXTRA.format(rank)))
    _barrier()
    if rank == 0:
        if os.path.exists(ckpt_dir):  # overwrite: un-mark the old one first, so a crash never leaves a marked mix
            unmark(ckpt_dir)
            shutil.rmtree(ckpt_dir)
        os.replace(staging, ckpt_dir)
        mark_complete(ckpt_dir)
    _barrier()
    return ckpt_dir


def load_sharded(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    ckpt_dir: str,
) -> dict[str, Any]:
    """Load a :func:`save_sharded` checkpoint in place; returns this rank's ``extra_state``.

    Collective. The model must already be sharded (``apply_fsdp``) and the optimizer built on its
    parameters; the mesh may differ from the one that saved (DCP reshards). ``extra_state`` falls
    back to rank 0's when this rank has none (different world size).

    Raises:
        FileNotFoundError: ``ckpt_dir`` lacks the ``COMPLETE`` marker (an interrupted save).
    """
    ckpt_dir = os.path.normpath(ckpt_dir)
    if not is_complete_checkpoint(ckpt_dir):
        raise FileNotFoundError(
            f"{ckpt_dir!r} is not a complete checkpoint (no {COMPLETE_MARKER} marker); "
            "use latest_complete_checkpoint(root) to find one"
        )
    state = _state(model, optimizer)
    _dcp().load(state, checkpoint_id=ckpt_dir)
    if optimizer is None:
        _state_dict_api().set_model_state_dict(model, state["model"])
    else:
        _state_dict_api().set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    path = os.path.join(ckpt_dir, _EXTRA.format(_rank()))
    if not os.path.isfile(path):
        path = os.path.join(ckpt_dir, _EXTRA.format(0))
    extra = torch.load(path, map_location="cpu", weights_only=True) if os.path.isfile(path) else {}
    _barrier()
    return extra


# ---- RNG helpers for extra_state ------------------------------------------------------------
def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy (if installed), torch CPU and accelerator RNG states of this process."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)
    except ImportError:  # pragma: no cover
        pass
    for dev in ("cuda", "npu"):
        mod = getattr(torch, dev, None)
        if mod is not None and getattr(mod, "is_available", lambda: False)():
            state[dev] = mod.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state` (missing entries are left alone)."""
    if "python" in state:
        random.setstate(state["python"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    for dev in ("cuda", "npu"):
        mod = getattr(torch, dev, None)
        if dev in state and mod is not None:
            mod.set_rng_state_all(state[dev])
