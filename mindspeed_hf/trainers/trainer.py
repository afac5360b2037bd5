"""MindSpeedTrainer: transformers.Trainer, explicitly accelerated.

It is the same path as a plain Trainer after `import mindspeed_hf` (the wiring, wiring.py, runs the lifecycle from
Trainer's own methods); using the class is an explicit request, so it wires Trainer even under MINDSPEED_HF_AUTO=0.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import Trainer, TrainingArguments

from ..patches import apply
from ..runtime import run_of
from . import lifecycle, wiring
from .enabling import enable


class MindSpeedTrainer(Trainer):
    """transformers.Trainer that runs the model on mindspeed_hf's fused kernels and, when asked for, the parallel
    axes (FSDP2, context, expert, tensor parallelism).

    Takes every Trainer argument. The config comes from MindSpeedTrainingArguments over the process config
    (mindspeed_hf.config gives the precedence) and belongs to this trainer and its model: other trainers and
    models in the process keep theirs.
    """

    def __init__(self, model: nn.Module | None = None, args: TrainingArguments | None = None, *rest: Any,
                 **kwargs: Any) -> None:
        if not wiring.is_installed():  # an explicit request: wire Trainer (and patch the kernels) if not yet,
            lifecycle.start(self, args)  # once the trainer's settings are checked: a bad one changes nothing
            enable(apply.explicit_process_config())
        super().__init__(model, args, *rest, **kwargs)

    @property
    def mindspeed_report(self) -> dict[str, Any] | None:
        """report() of the model as prepared (None before a model was given)."""
        run = run_of(self)
        return run.report if run is not None else None
