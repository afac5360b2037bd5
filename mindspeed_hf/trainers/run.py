"""One run object per trainer: everything mindspeed_hf decided and built for it, in one place.

A `Run` is created once, when the trainer's `__init__` starts (trainers/lifecycle.py), and kept on the trainer
as `_mindspeed_run`, the only attribute mindspeed_hf sets on a Trainer. It holds the trainer's resolved config,
its parallel plan (config -> plan), the mesh once `parallelize` built it, what the kernels did to the model, the
checkpoint being written and the background export of the last one saved. Every other module of the trainer floor
reads it through `run_of(trainer)`; nothing is passed along in loose trainer attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import MindSpeedConfig, ResolvedConfig, resolve_for
from ..parallel.dims import ParallelDims
from ..parallel.plan import ParallelPlan
from ..patches import apply
from .export_background import BackgroundExport
from .moe_balance import AuxFreeBalance
from .moe_load import ExpertLoad

__all__ = ["Run", "resolve_config", "run_of"]

_ATTRIBUTE = "_mindspeed_run"


@dataclass
class Run:
    """mindspeed_hf's state for one trainer."""

    args: Any = field(metadata={"help": "the trainer's TrainingArguments (kept before Trainer.__init__ runs)"})
    resolved: ResolvedConfig = field(metadata={"help": "the trainer's config, with where each setting came from"})
    plan: ParallelPlan | None = field(default=None, metadata={
        "help": "the parallel request (sizes, FSDP knobs, their sources); None: Trainer's own placement"})
    dims: ParallelDims | None = field(default=None, metadata={"help": "the built mesh, once the model is sharded"})
    device_type: str | None = field(default=None, metadata={"help": "the device type the mesh was built on"})
    report: dict[str, Any] | None = field(default=None, metadata={
        "help": "report() of the model as prepared (None before a model was given)"})
    checkpoint_dir: str | None | bool = field(default=False, metadata={
        "help": "inside Trainer's checkpoint save: None until save_model names the directory, then it; else False"})
    moe_load: ExpertLoad | None = field(default=None, metadata={
        "help": "the model's MoE expert-load counters (moe.log_load), read when Trainer logs the loss"})
    moe_balance: AuxFreeBalance | None = field(default=None, metadata={
        "help": "the model's auxiliary-loss-free expert biases (moe.balance=aux_free), updated after each step"})
    export: BackgroundExport | None = field(default=None, metadata={
        "help": "the background export of the last checkpoint saved (checkpoints.export_hf), until waited for"})

    @property
    def config(self) -> MindSpeedConfig:
        """The trainer's MindSpeedConfig (belongs to this trainer and its model, not to the process)."""
        return self.resolved.config

    @property
    def sharded(self) -> bool:
        """True when parallelize built a mesh for the model (FSDP2 and / or the other axes)."""
        return self.dims is not None


def run_of(trainer: Any) -> Run | None:
    """The trainer's Run (None: a trainer mindspeed_hf did not set up)."""
    return vars(trainer).get(_ATTRIBUTE) if hasattr(trainer, "__dict__") else None


def attach(trainer: Any, run: Run) -> Run:
    """Keep `run` on `trainer` (the one attribute mindspeed_hf sets on a Trainer)."""
    setattr(trainer, _ATTRIBUTE, run)
    return run


def resolve_config(args: Any) -> ResolvedConfig:
    """The accelerator config for a trainer: its arguments (set mindspeed_* fields, fsdp_config,
    parallelism_config) over the process config - a config given to enable(), else the MINDSPEED_HF_*
    variables, MINDSPEED_HF_CONFIG and the accelerate launch environment (precedence: mindspeed_hf.config)."""
    return resolve_for(args, base=apply.explicit_process_config())
