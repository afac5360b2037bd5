"""mindspeed_hf: a drop-in accelerator for Hugging Face training on Ascend NPU, CUDA and CPU.

`import mindspeed_hf` enables every kernel for the supported model families (set MINDSPEED_HF_AUTO=0 to import
without patching); `disable()` restores every patched symbol; `report(model)` says what really runs.
"""

from __future__ import annotations

import logging
import os

from . import versions
from .config import MindSpeedConfig, load_config
from .patches import apply_to_model, disable, enable, is_enabled, report
from .patches.apply import active_config

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
    _logger.setLevel(os.environ.get("MINDSPEED_HF_LOG_LEVEL", "INFO").upper())
    _logger.propagate = False


def get_config() -> MindSpeedConfig:
    """The active configuration (the one enable() used), else the one MINDSPEED_HF_CONFIG / defaults give."""
    return active_config() or load_config()


def __getattr__(name: str):
    # The trainer classes import transformers.Trainer (heavy): load them on first use.
    if name in ("MindSpeedTrainer", "MindSpeedTrainingArguments"):
        from . import trainers

        return getattr(trainers, name)
    raise AttributeError(f"module 'mindspeed_hf' has no attribute {name!r}")


__all__ = [
    "MindSpeedConfig",
    "MindSpeedTrainer",
    "MindSpeedTrainingArguments",
    "apply_to_model",
    "disable",
    "enable",
    "get_config",
    "is_enabled",
    "load_config",
    "report",
]

if os.environ.get("MINDSPEED_HF_AUTO", "1").strip().lower() not in ("0", "false", "no", "off"):
    _outside = versions.unsupported()
    if _outside:  # run as plain Hugging Face rather than fail somewhere obscure
        _logger.warning("mindspeed_hf: %s is outside the supported range (%s); the accelerator stays off and models "
                        "run unaccelerated", "; ".join(_outside), versions.describe())
    else:
        enable()
