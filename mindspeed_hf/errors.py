"""One line per mistake, whatever launched the program (python, torchrun, accelerate launch, a cluster's launcher).

A mistake mindspeed_hf finds in what it was given - a setting while a Trainer or an Accelerator is built, a
MINDSPEED_HF_* variable at import, a run started into another run's output_dir - is raised as usual (a caller may
catch it). If nothing catches it, it reaches the top of the program as one line, `mindspeed_hf: error: ...`, printed
by rank 0 only (every rank finds the same mistake), and every rank exits with status 1 without a traceback. With
MINDSPEED_HF_LOG_LEVEL=DEBUG the traceback is printed as Python would.

Imports nothing of the package: any layer may mark its errors.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TypeVar

__all__ = ["LOG_LEVELS", "debug_requested", "one_line", "say_once_if_uncaught"]

E = TypeVar("E", bound=BaseException)

#: MINDSPEED_HF_LOG_LEVEL's valid values (the logging module's level names)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_MARK = "_mindspeed_one_line"


def debug_requested() -> bool:
    """MINDSPEED_HF_LOG_LEVEL=DEBUG: tracebacks as Python prints them."""
    return os.environ.get("MINDSPEED_HF_LOG_LEVEL", "").strip().lower() == "debug"


def one_line(err: BaseException) -> str:
    """The error's text on one line (its type's name when it has no text)."""
    return " ".join(str(err).split()) or type(err).__name__


def _hook(kind: type, value: BaseException, traceback: Any, previous: Any) -> None:
    mark = getattr(value, _MARK, None)
    if not mark or debug_requested():
        previous(kind, value, traceback)
        return
    rank = os.environ.get("RANK", "0")
    if rank == "0" or mark == "every rank":  # the same mistake everywhere: rank 0 says it; a rank's own: it says it
        where = f" (rank {rank})" if rank != "0" else ""
        print(f"mindspeed_hf{where}: error: {one_line(value)} (MINDSPEED_HF_LOG_LEVEL=DEBUG shows the traceback)",
              file=sys.stderr, flush=True)
    else:  # under a launcher: let rank 0's line out before this exit makes the launcher stop the group
        time.sleep(2)


def say_once_if_uncaught(err: E, every_rank: bool = False) -> E:
    """Mark `err` (returned, to be raised): if it reaches the top of the program uncaught it is printed as one line
    by rank 0 and the process exits with status 1, no traceback (unless MINDSPEED_HF_LOG_LEVEL=DEBUG).
    `every_rank`: a failure that may be one rank's own (its disk, its files): every rank that meets it says it."""
    setattr(err, _MARK, "every rank" if every_rank else "rank 0")
    current = sys.excepthook
    if not getattr(current, _MARK, False):  # ours outermost (torch's rank-prefixing hook may wrap it later)
        def excepthook(kind: type, value: BaseException, traceback: Any) -> None:
            _hook(kind, value, traceback, current)

        setattr(excepthook, _MARK, True)
        sys.excepthook = excepthook
    return err
