"""TrainingArguments.__post_init__ with the DeepSpeed steps around it (trainers/deepspeed.py): wired as soon as
transformers' training_args module is imported, before (and without) the Trainer, since a script may build its
arguments first. Kept apart from wiring.py, which imports the Trainer's own modules: this one imports nothing of
transformers, so it can be wired while transformers is still importing its Trainer modules."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

from ..errors import say_once_if_uncaught
from ..patches.engine import PatchSet
from . import deepspeed
from .notices import ddp_notice_held

_patches = PatchSet()


@contextlib.contextmanager
def one_line_if_uncaught() -> Iterator[None]:
    """A mistake found while the trainer is built (a setting, its source and the valid choices): raised as usual,
    and if nobody catches it, one line from rank 0 and every rank exits 1 without a traceback (errors.py)."""
    try:
        yield
    except (ValueError, FileNotFoundError) as err:
        say_once_if_uncaught(err)
        raise


def _wrap_post_init(original: Callable) -> Callable:
    """use_cpu for a CPU multi-process DeepSpeed run before the devices are set up; afterwards the refusal of our
    parallelism with DeepSpeed and deepspeed.comm initialised, so a ZeRO-3 model built next under zero.Init is
    partitioned over every rank."""

    @functools.wraps(original)
    def __post_init__(self) -> None:
        with one_line_if_uncaught():
            deepspeed.before_arguments(self)
        with ddp_notice_held(self):  # released once the trainer knows whether we shard (release_ddp_notice)
            original(self)
        with one_line_if_uncaught():
            deepspeed.after_arguments(self)

    return __post_init__


def install_arguments_wiring(arguments_cls: type) -> None:
    """Wrap `arguments_cls.__post_init__` (transformers' TrainingArguments). Idempotent."""
    if _patches.is_patched(arguments_cls, "__post_init__"):
        return
    post_init = _wrap_post_init(vars(arguments_cls)["__post_init__"])
    post_init._mindspeed_wiring = True
    _patches.set(arguments_cls, "__post_init__", post_init)


def uninstall_arguments_wiring() -> None:
    """Put the original __post_init__ back. Idempotent."""
    _patches.restore_all()
