"""An accelerate loop's share of what a Trainer gets when things go wrong at scale (the accelerate seam calls these):

- the watch of a multi-process run (runtime/watchdog.py): armed when the loop's first model is prepared, the step
  counted by its optimizers' steps, saves (`save_state`) left out, disarmed at `end_training`;
- a restarted attempt (runtime/elastic.py): the loop's script owns resuming (`accelerator.load_state(...)` before it
  trains); a restarted loop whose first optimizer step comes without a load_state says so in one line, naming the
  newest complete save_state directory when accelerate names them itself.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..parallel.checkpoint import COMPLETE_MARKER
from . import elastic, watchdog
from .run import Run

__all__ = ["end", "follow", "noting_load", "while_saving"]

logger = logging.getLogger("mindspeed_hf")
_LOADED: weakref.WeakSet = weakref.WeakSet()  # the loops' accelerators that called load_state
_FOLLOWED = "_mindspeed_steps"


def follow(accelerator: Any, run: Run, prepared: tuple) -> None:
    """After `Accelerator.prepare` of a loop: the watch armed; each optimizer's steps counted."""
    elastic.check_launcher()
    watchdog.arm(run.config.parallel.collective_timeout)
    ref = weakref.ref(accelerator)
    from accelerate.optimizer import AcceleratedOptimizer

    for optimizer in prepared:
        while isinstance(optimizer, AcceleratedOptimizer):  # the torch optimizer inside: its step hooks run
            optimizer = optimizer.optimizer
        if isinstance(optimizer, torch.optim.Optimizer) and getattr(optimizer, _FOLLOWED, None) is None:
            setattr(optimizer, _FOLLOWED, 0)
            optimizer.register_step_post_hook(functools.partial(_stepped, ref))


def _stepped(ref: weakref.ref, optimizer: torch.optim.Optimizer, *_: Any) -> None:
    done = getattr(optimizer, _FOLLOWED) + 1
    setattr(optimizer, _FOLLOWED, done)
    watchdog.set_step(done + 1)
    accelerator = ref()
    if done == 1 and accelerator is not None:
        _say_restart(accelerator)


def _say_restart(accelerator: Any) -> None:
    """A restarted loop that trains without having loaded its state: one line (rank 0)."""
    again = elastic.restart()
    if again is None or accelerator in _LOADED or os.environ.get("RANK", "0") != "0":
        return
    newest = ""
    config = getattr(accelerator, "project_configuration", None)
    if config is not None and config.automatic_checkpoint_naming and accelerator.project_dir:
        found = _newest_saved(os.path.join(accelerator.project_dir, "checkpoints"))
        newest = f" (the newest saved: {found})" if found else " (none saved yet)"
    logger.warning("mindspeed_hf: %s: this accelerate loop trains from its first step: its script did not call "
                   "accelerator.load_state(...) before training%s; a loop resumes only through its own load_state",
                   again, newest)


def _newest_saved(root: str) -> str | None:
    """The newest `checkpoint_<n>` of accelerate's automatic naming: complete ones only where the run marks them
    (our sharded saves: runtime/state.py), else by number (accelerate's own saves carry no marker)."""
    found = sorted((int(name.rpartition("_")[2]), os.path.join(root, name)) for name in
                   (os.listdir(root) if os.path.isdir(root) else []) if name.rpartition("_")[2].isdigit())
    marked = [item for item in found if os.path.isfile(os.path.join(item[1], COMPLETE_MARKER))]
    chosen = marked or found
    return chosen[-1][1] if chosen else None


def noting_load(load_state: Callable) -> Callable:
    """Accelerator.load_state, remembered (a restarted loop that loaded its state is resuming)."""

    @functools.wraps(load_state)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = load_state(self, *args, **kwargs)
        _LOADED.add(self)
        return result

    return wrapper


def while_saving(save_state: Callable) -> Callable:
    """Accelerator.save_state with the watch told this rank is saving."""

    @functools.wraps(save_state)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with watchdog.saving():
            return save_state(self, *args, **kwargs)

    return wrapper


def end() -> None:
    """end_training: the watch disarmed."""
    watchdog.disarm()
