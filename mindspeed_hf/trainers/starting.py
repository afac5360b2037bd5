"""How a Trainer run starts in its output_dir: from a checkpoint when the user says so, or by itself when its launcher
restarted it; never over another run's checkpoints without being told to.

Settled when train() starts, before any step (`resolve_train_call`, from the wiring of Trainer.train):

- an explicit `resume_from_checkpoint` (a path, or True) wins: checked by checkpoints.resolve_resume;
- a restarted attempt (runtime/elastic.py: torchrun's TORCHELASTIC_RESTART_COUNT > 0, a SLURM requeue) given no
  resume argument resumes from the newest complete checkpoint of output_dir that reads, in one line; with none yet it
  starts over, in one line. The checkpoints of earlier attempts are the job's own;
- a new run (a first attempt, not resuming) into an output_dir holding complete checkpoints of another run stops
  before any work with one line giving the ways forward, unless `checkpoints.overwrite` (or transformers 4.x's
  `overwrite_output_dir`) says to replace them: they are then removed first, in one line. "Another run" is one this
  process did not start there: the runs of one process into one output_dir (a notebook, a test suite training twice
  into one directory) are one run's.

`mindspeed-hf train` makes the same check before it builds any model (`guard_new_run`).
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from ..checkpoints import background, layout
from ..errors import say_once_if_uncaught
from ..parallel.checkpoint import _barrier, _rank
from ..runtime import elastic, run_of
from . import checkpoints

__all__ = ["guard_new_run", "resolve_train_call", "settle"]

logger = logging.getLogger("mindspeed_hf")
#: output_dirs a run of this process started in: what is in them from then on is this process's own
_STARTED: set[str] = set()


def _key(output_dir: Any) -> str:
    return os.path.realpath(os.path.expanduser(str(output_dir)))


def _say(message: str, *args: Any) -> None:
    if _rank() == 0 and os.environ.get("RANK", "0") == "0":
        logger.info(message, *args)


def guard_new_run(output_dir: Any, overwrite: bool, args: Any = None) -> None:
    """A new run (not resuming, not a restart) may start in `output_dir`: nothing of another run there, or
    `overwrite` (checkpoints.overwrite; also transformers 4.x's `args.overwrite_output_dir`) and that run's checkpoints
    removed first (rank 0). Raises a one-line CheckpointError otherwise."""
    key = _key(output_dir)
    if key in _STARTED:
        return
    others = layout.complete_checkpoints(str(output_dir))
    if not others:
        _STARTED.add(key)
        return
    if overwrite or getattr(args, "overwrite_output_dir", False):
        _remove_checkpoints(str(output_dir))
        _STARTED.add(key)
        return
    names = [os.path.basename(path) for path in others]
    listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    step = layout.checkpoint_step(others[0])
    raise say_once_if_uncaught(layout.CheckpointError(
        f"output_dir {output_dir} holds another run's checkpoints ({listed}; the newest at step {step}): a new run "
        "would write over them, and a later resume would mix the two runs; choose one: resume that run "
        "(resume_from_checkpoint=True, --resume_from_checkpoint), train into a new output_dir, or replace them with "
        "checkpoints.overwrite=true (MINDSPEED_HF_CHECKPOINTS_OVERWRITE=1, --mindspeed_overwrite)"))


def _remove_checkpoints(output_dir: str) -> None:
    """checkpoints.overwrite: every checkpoint-N of the earlier run (finished or not) and its background export go
    before the new run writes anything, so the directory never mixes two runs (rank 0; every rank waits)."""
    found = layout.checkpoint_dirs(output_dir)
    if _rank() == 0 and os.environ.get("RANK", "0") == "0" and found:
        logger.info("mindspeed_hf: checkpoints.overwrite: removing the earlier run's %s from %s",
                    ", ".join(os.path.basename(p) for p in found), output_dir)
        for path in found:
            shutil.rmtree(path)
            shutil.rmtree(background.export_dir(path), ignore_errors=True)
    _barrier()


def _resume_restarted(output_dir: str, again: elastic.Restart) -> str | None:
    """A restarted attempt: the newest complete checkpoint that reads (one line), or None to start over (one line)."""
    try:
        path, fell_back = layout.find_newest(output_dir)
    except layout.CheckpointError:
        _say("mindspeed_hf: %s: no complete checkpoint in %s yet; training from the start", again, output_dir)
        return None
    checkpoints.say_resuming(path, fell_back, because=str(again))
    return path


def settle(trainer: Any, resume: Any) -> Any:
    """train()'s `resume_from_checkpoint` (None when not given) as Trainer should get it (see the module's doc)."""
    run = run_of(trainer)
    output_dir = trainer.args.output_dir
    again = elastic.restart()
    if resume not in (None, False, ""):  # the user's: checked
        settled = checkpoints.resolve_resume(trainer, resume, sharded=run.plan is not None)
    elif again is not None:  # the job's own checkpoints; an explicit False still starts over
        settled = _resume_restarted(output_dir, again) if resume is None else resume
    else:
        guard_new_run(output_dir, run.config.checkpoints.overwrite, trainer.args)
        settled = resume
    _STARTED.add(_key(output_dir))
    return settled


def resolve_train_call(trainer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Trainer.train's (args, kwargs) with `resume_from_checkpoint` settled (settle); a trainer mindspeed_hf did not
    set up (made before the wiring was installed) is left alone."""
    if run_of(trainer) is None:
        return args, kwargs
    if args:
        return (settle(trainer, args[0]), *args[1:]), kwargs
    settled = settle(trainer, kwargs.get("resume_from_checkpoint"))
    if "resume_from_checkpoint" in kwargs or settled is not None:
        kwargs = {**kwargs, "resume_from_checkpoint": settled}
    return args, kwargs
