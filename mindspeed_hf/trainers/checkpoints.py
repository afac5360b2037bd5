"""Crash-safe Trainer checkpoints for every run (one process, DDP, FSDP2), through Trainer's own saving.

Trainer's `_save_checkpoint` writes `checkpoint-N` in place, file by file, then rotates old checkpoints away. Around
it (never instead of it):

- staging: when Trainer's save enters `checkpoint-N` (its `save_model(output_dir, _internal_call=True)`), rank 0
  removes the directory's COMPLETE marker, so while the files are being written the directory is a staging one
  that nothing resumes from;
- publishing: once Trainer's body returned on every rank, rank 0 writes the COMPLETE marker (fsync'ed);
- rotation: Trainer's own rotation (`rotate_checkpoints`, 4.57: `_rotate_checkpoints`) is held back during the
  save and run after the marker, so `save_total_limit` can never delete the last complete checkpoint before the new
  one is published. Unmarked saves of a killed run numbered past the current step go first (they would be written
  over anyway), so they never count as "the most recent checkpoint" that rotation keeps;
- exporting (`checkpoints.export_hf`): once published, the checkpoint is exported as a Hugging Face directory in the
  background (trainers/background.py).

Resume (`resume_from_checkpoint=True`) takes the newest complete checkpoint whose files can be read: directories
without the marker are skipped with a line saying so, and a complete one with a truncated file (weights,
optimizer, scheduler, RNG state, trainer state) gives one error line naming the file and falls back to the
previous complete checkpoint. An output_dir written entirely without mindspeed_hf (no marker anywhere) is read by
Hugging Face's own rule (the newest directory with trainer_state.json).
"""

from __future__ import annotations

import ast
import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

from ..checkpoints import background
from ..checkpoints.layout import (
    PREFIX,
    CheckpointError,
    check_checkpoint,
    checkpoint_dirs,
    checkpoint_step,
    find_newest,
    finished,
    say_once,
    step_of,
)
from ..errors import say_once_if_uncaught
from ..parallel.checkpoint import COMPLETE_MARKER, _barrier, _rank, is_complete_checkpoint, mark_complete, unmark
from ..runtime import run_of, watchdog

__all__ = ["begin_checkpoint_dir", "load_best_model", "load_from_checkpoint", "resolve_resume", "say_resuming",
           "save_checkpoint", "save_model", "tied_keys_quiet"]

logger = logging.getLogger("mindspeed_hf")


def say_resuming(path: str, fell_back: bool, because: str = "") -> None:
    """The one line every resumed run logs: which checkpoint, at which step (`because`: what resumed it, when not
    the user)."""
    step = checkpoint_step(path)
    why = "; the newest complete checkpoint that reads" if fell_back else ""
    say_once(logging.INFO if not fell_back else logging.WARNING, "mindspeed_hf: %sresuming from %s (step %s%s)",
         f"{because}: " if because else "", path, "?" if step is None else step, why)


def resolve_resume(trainer: Any, resume: Any, sharded: bool = False) -> Any:
    """Trainer.train's resume_from_checkpoint, settled: True -> the newest complete readable checkpoint of the
    run's output_dir; a path -> checked (marker, readable files); anything else unchanged. A resumed run logs one
    line: "resuming from <path> (step N)"."""
    if resume is True:
        path, fell_back = find_newest(trainer.args.output_dir)
    elif isinstance(resume, str | os.PathLike) and str(resume):
        path, fell_back = check_checkpoint(str(resume), sharded), False
    else:
        return resume
    say_resuming(path, fell_back)
    return path


# ---------------------------------------------------------------------------------------------- saving
def begin_checkpoint_dir(trainer: Any, output_dir: str) -> bool:
    """Called from save_model: inside Trainer's checkpoint save, record `output_dir` and take its marker away (the
    directory is being written: staging) on every rank's behalf. False for any other save_model call."""
    run = run_of(trainer)
    if run is None or run.checkpoint_dir is not None:
        return False
    run.checkpoint_dir = output_dir
    if _rank() == 0:
        os.makedirs(output_dir, exist_ok=True)
        unmark(output_dir)
    _barrier()
    return True


@contextlib.contextmanager
def _rotation_held(trainer: Any, held: list[Callable[[], None]]) -> Iterator[None]:
    """Trainer's rotation recorded into `held` instead of run (5.x: transformers.trainer.rotate_checkpoints;
    4.57: the trainer's _rotate_checkpoints)."""
    import transformers.trainer as hf_trainer

    original = getattr(hf_trainer, "rotate_checkpoints", None)
    if original is not None:
        def rotate_checkpoints(*args: Any, **kwargs: Any) -> None:
            held.append(lambda: original(*args, **kwargs))

        hf_trainer.rotate_checkpoints = rotate_checkpoints
        try:
            yield
        finally:
            hf_trainer.rotate_checkpoints = original
        return
    method = trainer._rotate_checkpoints
    trainer._rotate_checkpoints = lambda *args, **kwargs: held.append(lambda: method(*args, **kwargs))
    try:
        yield
    finally:
        del trainer._rotate_checkpoints


def _drop_stale_saves(run_dir: str, step: int) -> None:
    """Unmarked checkpoint dirs numbered past `step`: interrupted saves of a killed run that this run has not
    reached again. Rotation would keep one as "the most recent" in place of the checkpoint just published. In a
    directory written without mindspeed_hf (no marker before `step`) Hugging Face's rule says what finished."""
    found = checkpoint_dirs(run_dir)
    marked_run = any(is_complete_checkpoint(p) for p in found if (step_of(os.path.basename(p)) or 0) < step)
    for path in found:
        number = step_of(os.path.basename(path))
        if number is not None and number > step and not finished(path, marked_run):
            say_once(logging.INFO, "mindspeed_hf: removing %s (an interrupted save past step %d)", path, step)
            shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(trainer: Any, original: Callable, *args: Any, **kwargs: Any) -> None:
    """Trainer's own `_save_checkpoint` (bound `original`), made atomic: staging while it writes, the COMPLETE
    marker once every rank is done, then Trainer's rotation. Collective under torch.distributed. The hang watch
    knows this rank is saving (rank 0 may write, or wait for the previous export, while the others wait)."""
    with watchdog.saving():
        _save_checkpoint(trainer, original, *args, **kwargs)


def _save_checkpoint(trainer: Any, original: Callable, *args: Any, **kwargs: Any) -> None:
    held: list[Callable[[], None]] = []
    run = run_of(trainer)
    run.checkpoint_dir = None  # "inside a checkpoint save": save_model records the directory
    try:
        with _rotation_held(trainer, held):
            original(*args, **kwargs)
        written = run.checkpoint_dir
    except Exception as err:  # noqa: BLE001 - a file-system failure (disk full, ...) becomes one line; others go on
        failure = _os_error(err)
        if failure is None:
            raise
        raise say_once_if_uncaught(_save_failed(trainer, run.checkpoint_dir, failure), every_rank=True) from err
    finally:
        run.checkpoint_dir = False
    _barrier()
    if _rank() == 0 and written:
        mark_complete(written, global_step=trainer.state.global_step)
        if run.config.checkpoints.export_hf:  # the previous export first: rotation may remove its checkpoint next
            background.finish(run.export)
            run.export = background.start(written)
    _barrier()
    if held and written and trainer.args.save_total_limit:
        _drop_stale_saves(os.path.dirname(os.path.normpath(written)), trainer.state.global_step)
    for rotate in held:  # Trainer calls it where it should (should_save); the newest kept is the one just marked
        rotate()


def _os_error(err: BaseException) -> OSError | None:
    """The file-system error behind `err`: itself, its cause, or a rank's failure inside DCP's CheckpointException
    (its `failures`: rank -> exception, or (exception, traceback))."""
    seen: list[BaseException] = [err]
    while seen:
        current = seen.pop(0)
        if isinstance(current, OSError):
            return current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            seen += [f[0] if isinstance(f, tuple) else f for f in failures.values() if f is not None]
        seen += [e for e in (current.__cause__, current.__context__) if e is not None]
    return None


def _save_failed(trainer: Any, directory: str | None, err: OSError) -> OSError:
    """One line for a checkpoint save the file system refused: what, where, and what the run can resume from."""
    run_dir = trainer.args.output_dir
    directory = directory or os.path.join(run_dir, f"{PREFIX}-{trainer.state.global_step}")
    try:
        newest = f"the newest complete one is {os.path.basename(find_newest(run_dir, quiet=True)[0])}"
    except CheckpointError:
        newest = "no complete checkpoint to resume from yet"
    what = err.strerror or str(err)
    where = f" writing {err.filename}" if err.filename else ""
    failed = OSError(f"saving checkpoint {directory} failed{where}: {what}; it has no {COMPLETE_MARKER} marker and is "
                     f"never resumed from, {newest}: make room (or fix the file system) and run again with "
                     "resume_from_checkpoint=True (--resume_from_checkpoint)")
    failed.errno = err.errno
    return failed


def save_model(trainer: Any, original: Callable, output_dir: str | None = None, _internal_call: bool = False) -> None:
    """Trainer's own save_model; when Trainer's checkpoint save calls it, the directory becomes a staging one."""
    begin_checkpoint_dir(trainer, output_dir or trainer.args.output_dir)
    original(output_dir, _internal_call=_internal_call)


# ---------------------------------------------------------------------------------------------- loading
#: Trainer's warning after loading weights (transformers.trainer, 4.57 .. 5.x), followed by the key list.
MISSING_KEYS = "There were missing keys in the checkpoint model loaded: "


def tied_names(model: Any) -> dict[str, set[str]]:
    """Parameter name -> the other names of the same tensor (tied weights: `lm_head.weight` and
    `model.embed_tokens.weight` of a model with tie_word_embeddings); untied parameters are not listed."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return {name: set(names) - {name} for names in groups.values() if len(names) > 1 for name in names}


class TiedKeysFilter(logging.Filter):
    """Trainer's missing-keys warning without the keys tied to a weight that was loaded (a checkpoint stores a tied
    tensor once: its other name is "missing" but loaded all the same); the warning is dropped when nothing else
    is missing."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.tied = tied_names(model)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(MISSING_KEYS):
            return True
        try:
            keys = list(ast.literal_eval(message[len(MISSING_KEYS):].strip().rstrip(".")))
        except (ValueError, SyntaxError):
            return True
        missing = set(keys)
        real = [k for k in keys if not (self.tied.get(k, set()) - missing)]
        if not real:
            return False
        record.msg, record.args = f"{MISSING_KEYS}{real}.", ()
        return True


@contextlib.contextmanager
def tied_keys_quiet(model: Any) -> Iterator[None]:
    """While Trainer loads weights into `model`: its missing-keys warning leaves out keys tied to a loaded weight."""
    hf_logger = logging.getLogger("transformers.trainer")
    gate = TiedKeysFilter(model)
    hf_logger.addFilter(gate)
    try:
        yield
    finally:
        hf_logger.removeFilter(gate)


def load_from_checkpoint(trainer: Any, original: Callable, path: str, model: Any = None) -> None:
    """Trainer's own `_load_from_checkpoint`, its missing-keys warning without tied keys."""
    with tied_keys_quiet(model if model is not None else trainer.model):
        original(path, model) if model is not None else original(path)


def load_best_model(trainer: Any, original: Callable) -> None:
    """Trainer's own `_load_best_model`, its missing-keys warning without tied keys."""
    with tied_keys_quiet(trainer.model):
        original()


#: Trainer method name -> implementation(trainer, bound original, ...), for every run that is not FSDP2-sharded
#: (fsdp.OVERRIDES has the sharded versions, which use the same save_checkpoint / begin_checkpoint_dir).
PLAIN: dict[str, Callable[..., Any]] = {"_save_checkpoint": save_checkpoint, "save_model": save_model,
                                        "_load_from_checkpoint": load_from_checkpoint,
                                        "_load_best_model": load_best_model}
