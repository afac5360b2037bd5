"""Trainer integration: MindSpeedTrainingArguments, MindSpeedTrainer, and the drop-in wiring that makes a plain
transformers.Trainer (and TRL's SFTTrainer) behave the same after `import mindspeed_hf`."""

from ..runtime import Run, run_of
from .arguments import MindSpeedTrainingArguments
from .trainer import MindSpeedTrainer
from .wiring import install_trainer_wiring, is_installed, uninstall_trainer_wiring

__all__ = [
    "MindSpeedTrainer",
    "MindSpeedTrainingArguments",
    "Run",
    "install_trainer_wiring",
    "is_installed",
    "run_of",
    "uninstall_trainer_wiring",
]
