"""accelerate's `save_state` / `load_state` for models we sharded: DCP shards, complete or absent.

accelerate saves a model it did not shard by gathering nothing: rank 0 writes `model.safetensors` from its own
state dict and `optimizer.bin` from its own optimizer state, which for our DTensor shards would be one rank's share.
So around accelerate's own save (which still writes everything else: schedulers, data-loader samplers, RNG states,
the gradient scaler, registered objects, and whatever the script's save hooks write) our sharded models and their
optimizers go in as DCP shards, in the directories accelerate's own FSDP uses (`pytorch_model_fsdp_<i>`,
`optimizer_<i>`), with the model's config beside them (what `mindspeed-hf export` rebuilds the model from):

- a save starts by removing the directory's COMPLETE marker (rank 0), so while the files are being written the
  directory is a staging one that nothing loads;
- once accelerate's body returned on every rank, rank 0 writes the COMPLETE marker (fsync'ed, renamed into place);
- `load_state` of a directory without the marker stops in one line before anything is read; with accelerate's
  automatic checkpoint naming and no directory given, the newest complete checkpoint is taken (unmarked ones are
  skipped with a line saying so).
"""

from __future__ import annotations

import logging
import os
import re

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from .. import parallel
from ..checkpoints.layout import MODEL_DIRS, OPTIMIZER_DIRS
from ..parallel.checkpoint import COMPLETE_MARKER, STAGING_SUFFIX, _barrier, _rank, mark_complete, unmark

__all__ = ["StateError", "begin", "check_loadable", "finish", "newest_complete",
           "read_shards", "save_configs", "write_shards"]

logger = logging.getLogger("mindspeed_hf")


class StateError(ValueError):
    """A state directory that cannot be loaded (one line: the directory, and what to do)."""


def save_configs(model: nn.Module, save_directory: str) -> None:
    """Beside a checkpoint's shards, what names the model: its config (with its architectures, as HF's
    save_pretrained sets them) and generation config, and a PEFT model's adapter configs - what
    `mindspeed-hf export` rebuilds the model from."""
    os.makedirs(save_directory, exist_ok=True)
    hf_model = parallel.unwrap_hf_model(model)
    config = getattr(hf_model, "config", None)
    if config is None or not callable(getattr(config, "save_pretrained", None)):
        return
    # the model's own class, not the FSDP2 subclass fully_shard made (FSDP<Class>)
    own = next((c for c in type(hf_model).__mro__ if not issubclass(c, FSDPModule)), type(hf_model))
    config.architectures = [own.__name__]
    config.save_pretrained(save_directory)
    can_generate = getattr(hf_model, "can_generate", lambda: False)
    if getattr(hf_model, "generation_config", None) is not None and can_generate():
        hf_model.generation_config.save_pretrained(save_directory)
    for name, adapter in (getattr(model, "peft_config", None) or {}).items():
        adapter.save_pretrained(save_directory if name == "default" else os.path.join(save_directory, name))


def owner_of(optimizer: torch.optim.Optimizer, models: list[nn.Module]) -> int | None:
    """The index of the model whose parameters `optimizer` updates (None: none of `models`)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return next((i for i, model in enumerate(models) if any(id(p) in params for p in model.parameters())), None)


def begin(directory: str) -> None:
    """Before anything of a save is written into `directory`: not complete (rank 0 removes the marker)."""
    if _rank() == 0:
        os.makedirs(directory, exist_ok=True)
        unmark(directory)
    _barrier()


def write_shards(models: list[nn.Module], optimizers: list[torch.optim.Optimizer], directory: str) -> None:
    """Every rank's model shards and optimizer shards (DCP), and the first model's configs (collective)."""
    for i, model in enumerate(models):
        parallel.save_model_shards(model, os.path.join(directory, MODEL_DIRS.format(i)))
    for optimizer in optimizers:
        i = owner_of(optimizer, models)
        parallel.save_optimizer_shards(models[i], optimizer, os.path.join(directory, OPTIMIZER_DIRS.format(i)))
    if _rank() == 0 and models:
        save_configs(models[0], directory)


def finish(directory: str) -> None:
    """Once every rank's save returned: the COMPLETE marker (rank 0), then every rank goes on."""
    _barrier()
    if _rank() == 0:
        mark_complete(directory)
    _barrier()


def check_loadable(directory: str) -> None:
    """Refuse, in one line, a directory without the COMPLETE marker or without our model shards."""
    if not os.path.isdir(directory):
        raise StateError(f"load_state: {directory} does not exist")
    if not os.path.isfile(os.path.join(directory, COMPLETE_MARKER)):
        raise StateError(f"load_state: {directory} is not a complete checkpoint (no {COMPLETE_MARKER} marker: its "
                         "save was interrupted); load an earlier one, or pass no directory with automatic checkpoint "
                         "naming to take the newest complete one")
    if not os.path.isdir(os.path.join(directory, MODEL_DIRS.format(0))):
        raise StateError(f"load_state: {directory} holds no sharded model ({MODEL_DIRS.format(0)}/): it was not "
                         "saved from a run mindspeed_hf sharded; load it with the same parallel settings it was saved "
                         "with")


def newest_complete(root: str) -> str:
    """The newest complete `checkpoint_<n>` directory under `root` (accelerate's automatic naming); the unmarked
    ones newer than it are named in one line."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        number = re.search(r"(\d+)$", name)
        if os.path.isdir(path) and number and not name.endswith(STAGING_SUFFIX):
            found.append((int(number.group(1)), path))
    found.sort()
    complete = [(n, path) for n, path in found if os.path.isfile(os.path.join(path, COMPLETE_MARKER))]
    if not complete:
        raise StateError(f"load_state: no complete checkpoint under {root}")
    newest, chosen = complete[-1]
    skipped = [path for n, path in found if n > newest]
    if skipped and _rank() == 0:
        logger.warning("mindspeed_hf: load_state skips %s (save interrupted, no %s marker)", ", ".join(skipped),
                       COMPLETE_MARKER)
    return chosen


def read_shards(models: list[nn.Module], optimizers: list[torch.optim.Optimizer], directory: str) -> None:
    """Model shards and optimizer shards back into the sharded models and their optimizers (collective)."""
    for i, model in enumerate(models):
        parallel.load_model_shards(model, os.path.join(directory, MODEL_DIRS.format(i)))
    for optimizer in optimizers:
        i = owner_of(optimizer, models)
        path = os.path.join(directory, OPTIMIZER_DIRS.format(i))
        if os.path.isdir(path):
            parallel.load_optimizer_shards(models[i], optimizer, path)
