"""mindspeed_hf: a drop-in accelerator for Hugging Face training on Ascend NPU, CUDA and CPU.

`import mindspeed_hf` enables every kernel for the supported model families (set MINDSPEED_HF_AUTO=0 to import
without patching); `disable()` restores every patched symbol; `report(model)` says what really runs.

The package itself imports no torch: the patching API (enable, disable, report, ...) loads on first use, and the
`mindspeed-hf` command enables the accelerator itself once it has read its arguments (so `--help` is instant and a
bad MINDSPEED_HF_* setting is the command's one-line error, not an import traceback).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from . import errors
from .config import MindSpeedConfig, load_config
from .releases import supported

__version__ = "0.1.0"

# One visible line per model on what was applied: like transformers, the library logger has its own handler
# (level from MINDSPEED_HF_LOG_LEVEL, default INFO) and does not propagate, so nothing prints twice.
_logger = logging.getLogger("mindspeed_hf")
if not _logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    # Under torchrun, info lines come from rank 0 only; warnings from every rank.
    _handler.addFilter(lambda r: r.levelno >= logging.WARNING or os.environ.get("RANK", "0") == "0")
    _logger.addHandler(_handler)
    _level = os.environ.get("MINDSPEED_HF_LOG_LEVEL", "INFO").strip().upper()
    _logger.setLevel(_level if _level.lower() in errors.LOG_LEVELS else "INFO")  # a bad value: auto_enable says so
    _logger.propagate = False


# Loaded on first use (they import torch and transformers): name -> module.
_LAZY = {**dict.fromkeys(("active_config", "apply_to_model", "is_enabled", "report"), "mindspeed_hf.patches.apply"),
         **dict.fromkeys(("disable", "enable"), "mindspeed_hf.trainers.enabling"),
         **dict.fromkeys(("MindSpeedTrainer", "MindSpeedTrainingArguments"), "mindspeed_hf.trainers"),
         "export": "mindspeed_hf.checkpoints.export", "FlatteningCollator": "mindspeed_hf.data"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # the same object as the module's, found directly from now on
        return value
    raise AttributeError(f"module 'mindspeed_hf' has no attribute {name!r}")


def get_config() -> MindSpeedConfig:
    """The active configuration (the one enable() used), else the one MINDSPEED_HF_CONFIG / defaults give."""
    from .patches.apply import active_config

    return active_config() or load_config()


def auto_requested() -> bool:
    """MINDSPEED_HF_AUTO is on (unset, or true/on/yes/1); off is false/off/no/0. Any other value is a one-line
    ValueError naming the variable."""
    from .value_kinds import parse_flag

    return parse_flag(os.environ.get("MINDSPEED_HF_AUTO", "1"), "MINDSPEED_HF_AUTO")


def auto_enable() -> None:
    """What `import mindspeed_hf` does: enable() unless MINDSPEED_HF_AUTO=0.

    All or nothing: a release we cannot serve (outside the supported range, or lacking an internal the Trainer
    wiring needs) gives one warning, and nothing is patched: models run as plain Hugging Face. A wrong setting
    (MINDSPEED_HF_AUTO, MINDSPEED_HF_LOG_LEVEL, MINDSPEED_HF_CONFIG, a MINDSPEED_HF_* variable) raises, printed as
    one line if nobody catches it (mindspeed_hf.errors)."""
    from .config.sources import check_process_switches

    try:
        check_process_switches(os.environ)
    except ValueError as err:
        raise errors.say_once_if_uncaught(err) from None
    if not auto_requested():
        return
    outside = supported.unsupported()
    if outside:  # run as plain Hugging Face rather than fail somewhere obscure
        _logger.warning("mindspeed_hf: %s is outside the supported range (%s); the accelerator stays off and models "
                        "run unaccelerated", "; ".join(outside), supported.describe())
        return
    from .trainers.enabling import UnsupportedReleaseError, enable

    try:
        enable()
    except UnsupportedReleaseError as err:
        _logger.warning("%s. The accelerator stays off: nothing was patched, models run unaccelerated", err)
    except (ValueError, FileNotFoundError) as err:
        raise errors.say_once_if_uncaught(err) from None


def _is_the_command() -> bool:
    """This process is the `mindspeed-hf` command (console script, or `python -m mindspeed_hf.cli.main`): it calls
    auto_enable() itself after reading its arguments."""
    argv = list(getattr(sys, "orig_argv", []))
    if os.path.basename(sys.argv[0] if sys.argv else "") == "mindspeed-hf":
        return True
    return any(a == "-m" and b == "mindspeed_hf.cli.main" for a, b in zip(argv, argv[1:], strict=False))


__all__ = [
    "FlatteningCollator",
    "MindSpeedConfig",
    "MindSpeedTrainer",
    "MindSpeedTrainingArguments",
    "apply_to_model",
    "auto_enable",
    "disable",
    "enable",
    "export",
    "get_config",
    "is_enabled",
    "load_config",
    "report",
]

if not _is_the_command():
    auto_enable()
