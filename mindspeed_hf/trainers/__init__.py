"""Trainer integration: MindSpeedTrainingArguments, MindSpeedTrainer, and the drop-in wiring that makes a plain
transformers.Trainer (and TRL's SFTTrainer) behave the same after `import mindspeed_hf`.

Its Trainer modules load on first use: importing them imports transformers' Trainer (and with it PEFT, bitsandbytes
and datasets, seconds of start-up), which a script that trains without a Trainer never needs."""

from __future__ import annotations

import importlib
from typing import Any

from ..runtime import Run, run_of

_LAZY = {"MindSpeedTrainer": ".trainer", "MindSpeedTrainingArguments": ".arguments",
         **dict.fromkeys(("install_trainer_wiring", "is_installed", "uninstall_trainer_wiring"), ".wiring")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MindSpeedTrainer",
    "MindSpeedTrainingArguments",
    "Run",
    "install_trainer_wiring",
    "is_installed",
    "run_of",
    "uninstall_trainer_wiring",
]
