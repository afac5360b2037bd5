"""What a run's output directory holds and which of its checkpoints can be used: the names (Trainer's
`checkpoint-N`, its trainer_state.json, accelerate's sharded model and optimizer directories), the newest complete
checkpoint whose files read whole, and an explicitly given checkpoint checked for resume or export (one line when
it cannot be used). Complete means the COMPLETE marker a finished save writes (parallel/checkpoint.py); in a
directory written entirely without mindspeed_hf, Hugging Face's own rule (trainer_state.json)."""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

from ..parallel.checkpoint import COMPLETE_MARKER, _rank, is_complete_checkpoint
from .readable import unreadable_file

__all__ = ["MODEL_DIR", "OPTIMIZER_DIR", "PREFIX", "TRAINER_STATE", "CheckpointError", "check_checkpoint",
           "checkpoint_dirs", "checkpoint_step", "complete_checkpoints", "find_newest", "finished",
           "newest_resumable", "say_once", "step_of"]

logger = logging.getLogger("mindspeed_hf")
#: accelerate's names of the sharded model and optimizer directories, per model index (Trainer has one: 0)
MODEL_DIRS, OPTIMIZER_DIRS = "pytorch_model_fsdp_{}", "optimizer_{}"
MODEL_DIR, OPTIMIZER_DIR = MODEL_DIRS.format(0), OPTIMIZER_DIRS.format(0)
PREFIX = "checkpoint"
TRAINER_STATE = "trainer_state.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (one line: the directory or file, and what to do)."""


def say_once(level: int, message: str, *args: Any) -> None:
    """Log once per run (rank 0): every rank reaches the same verdict on the same files."""
    if _rank() == 0 and os.environ.get("RANK", "0") == "0":
        logger.log(level, message, *args)


def step_of(name: str) -> int | None:
    m = re.fullmatch(rf"{PREFIX}-(\d+)", name)
    return int(m.group(1)) if m else None


def checkpoint_dirs(run_dir: str) -> list[str]:
    """checkpoint-N directories of `run_dir`, newest (largest N) first."""
    if not os.path.isdir(run_dir):
        return []
    found = [(step_of(n), os.path.join(run_dir, n)) for n in os.listdir(run_dir)]
    return [path for step, path in sorted((f for f in found if f[0] is not None), reverse=True) if os.path.isdir(path)]


def finished(path: str, marked_run: bool) -> bool:
    """Complete: the marker; in a directory written without mindspeed_hf, Trainer's last file (its own rule)."""
    return is_complete_checkpoint(path) if marked_run else os.path.isfile(os.path.join(path, TRAINER_STATE))


def complete_checkpoints(run_dir: str) -> list[str]:
    """The checkpoint-N directories of `run_dir` whose save finished (the COMPLETE marker; in a directory written
    without mindspeed_hf, Trainer's trainer_state.json), newest first."""
    found = checkpoint_dirs(run_dir)
    marked_run = any(is_complete_checkpoint(p) for p in found)
    return [path for path in found if finished(path, marked_run)]


def newest_resumable(run_dir: str) -> str:
    """The newest complete checkpoint of `run_dir` whose files can all be read; says which it skipped and why.

    Raises:
        CheckpointError: there is none.
    """
    return find_newest(run_dir)[0]


def find_newest(run_dir: str, quiet: bool = False) -> tuple[str, bool]:
    """(newest_resumable's answer, whether a newer complete checkpoint that does not read was passed over);
    `quiet`: without the lines saying what was skipped."""
    say = (lambda *a: None) if quiet else say_once
    found = checkpoint_dirs(run_dir)
    if not found:  # Hugging Face's own text first (what code written against plain Trainer matches on)
        raise CheckpointError(f"No valid checkpoint found in output directory ({run_dir}): no checkpoint-N directory "
                              "in output_dir; give a checkpoint path, or the output_dir of the run")
    marked_run = any(is_complete_checkpoint(p) for p in found)
    if not marked_run:
        say(logging.INFO, "mindspeed_hf: %s has no %s marker anywhere (written without mindspeed_hf): resuming "
            "by Hugging Face's rule (the newest checkpoint with %s)", run_dir, COMPLETE_MARKER, TRAINER_STATE)
    broken = None
    for path in found:
        if not finished(path, marked_run):
            say(logging.WARNING, "mindspeed_hf: skipping %s: no %s marker (a save that did not finish)", path,
                COMPLETE_MARKER if marked_run else TRAINER_STATE)
            continue
        problem = unreadable_file(path)
        if problem:
            say(logging.ERROR, "mindspeed_hf: checkpoint %s cannot be read: %s; falling back to the previous "
                "complete checkpoint", path, problem)
            broken = broken or problem
            continue
        return path, broken is not None
    detail = f" (newest unreadable file: {broken})" if broken else ""
    raise CheckpointError(f"No valid checkpoint found in output directory ({run_dir}): no complete checkpoint in "
                          f"output_dir{detail}; train without resume_from_checkpoint, or give a checkpoint directory")


def _not_valid(path: str, why: str, purpose: str) -> CheckpointError:
    """A refused checkpoint path. To resume: Hugging Face's own text first ("Can't find a valid checkpoint at", what
    code written against plain Trainer matches on), then our reason; to export: what export can do instead."""
    if purpose == "export":
        return CheckpointError(f"export: {path} is not a checkpoint that can be exported: {why}")
    return CheckpointError(f"Can't find a valid checkpoint at {path!r}: {why}")


def _what_to_do(purpose: str) -> str:
    if purpose == "export":
        return "export an earlier checkpoint of the run"
    return "resume from an earlier checkpoint, or resume_from_checkpoint=True for the newest one that reads"


def check_checkpoint(path: str, sharded: bool, purpose: str = "resume") -> str:
    """An explicitly given checkpoint directory, checked: it exists, its save finished, its files read whole.
    `purpose` ("resume" or "export") words the refusal."""
    path = os.path.normpath(str(path))
    if not os.path.isdir(path):
        raise _not_valid(path, "not a directory" if not os.path.exists(path) else "not a directory (a file)", purpose)
    siblings = checkpoint_dirs(os.path.dirname(path) or ".")
    legacy = (not sharded and os.path.isfile(os.path.join(path, TRAINER_STATE))  # a run written without mindspeed_hf
              and not any(is_complete_checkpoint(p) for p in siblings))
    if not is_complete_checkpoint(path) and not legacy:
        instead = (_what_to_do(purpose) if purpose == "export"
                   else "resume_from_checkpoint=True picks the newest complete one")
        raise _not_valid(path, f"no {COMPLETE_MARKER} marker (an interrupted save); {instead}", purpose)
    problem = unreadable_file(path)
    if problem:
        raise _not_valid(path, f"{problem}; {_what_to_do(purpose)}", purpose)
    return path


def checkpoint_step(path: str) -> int | None:
    """The global step a checkpoint was written at: its trainer_state.json, else its name (checkpoint-N)."""
    try:
        with open(os.path.join(path, TRAINER_STATE)) as f:
            return int(json.load(f)["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return step_of(os.path.basename(os.path.normpath(path)))
