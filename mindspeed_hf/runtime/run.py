"""One run object per owner - a Trainer, or an `accelerate.Accelerator` a script made - holding everything
mindspeed_hf decided and built for it.

A `Run` is created once, before its owner does any work: a trainer's when its `__init__` starts
(trainers/lifecycle.py), an Accelerator's when its `__init__` starts (runtime/accelerator.py). A Trainer's own
Accelerator adopts the trainer's Run, so a Trainer has one run whichever door a model goes through. It holds the
resolved config, the parallel plan (config -> plan), the mesh once built, the models it prepared and what the
kernels did to them; trainer-only state (the checkpoint being written, its background export) rides along. It is
kept on its owner as `_mindspeed_run`, the only attribute mindspeed_hf sets there; every module reads it through
`run_of(owner)`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..config import MindSpeedConfig, ResolvedConfig, resolve_for
from ..moe import AuxFreeBalance, ExpertLoad
from ..parallel.dims import ParallelDims
from ..parallel.plan import ParallelPlan
from ..patches import apply

__all__ = ["Run", "attach", "resolve_config", "run_of"]

_ATTRIBUTE = "_mindspeed_run"


@dataclass
class Run:
    """mindspeed_hf's state for one trainer or accelerator."""

    args: Any = field(metadata={"help": "the trainer's TrainingArguments (None for an accelerate loop)"})
    resolved: ResolvedConfig = field(metadata={"help": "the owner's config, with where each setting came from"})
    plan: ParallelPlan | None = field(default=None, metadata={
        "help": "the parallel request (sizes, FSDP knobs, their sources); None: the owner's own placement"})
    owner: str = field(default="Trainer", metadata={"help": "what runs the training, for messages"})
    param_dtype: Any = field(default=None, metadata={
        "help": "the run's bf16 / fp16 mixed precision (FSDP2 computes in it, master weights stay fp32), or None"})
    dims: ParallelDims | None = field(default=None, metadata={"help": "the built mesh, once there is one"})
    device_type: str | None = field(default=None, metadata={"help": "the device type the mesh was built on"})
    report: dict[str, Any] | None = field(default=None, metadata={
        "help": "report() of the model as prepared (None before a model was given)"})
    models: weakref.WeakSet = field(default_factory=weakref.WeakSet, metadata={
        "help": "the models this run prepared (kernels attached, parallelize applied)"})
    checkpoint_dir: str | None | bool = field(default=False, metadata={
        "help": "inside Trainer's checkpoint save: None until save_model names the directory, then it; else False"})
    moe_load: ExpertLoad | None = field(default=None, metadata={
        "help": "the model's MoE expert-load counters (moe.log_load), read when Trainer logs the loss"})
    moe_balance: AuxFreeBalance | None = field(default=None, metadata={
        "help": "the model's auxiliary-loss-free expert biases (moe.balance=aux_free), updated after each step"})
    export: Any = field(default=None, metadata={
        "help": "a trainer's background export of the last checkpoint saved (checkpoints.export_hf), until waited for"})

    @property
    def config(self) -> MindSpeedConfig:
        """The owner's MindSpeedConfig (belongs to it and its model, not to the process)."""
        return self.resolved.config

    @property
    def sharded(self) -> bool:
        """True when a mesh was built for the run (FSDP2 and / or the other axes)."""
        return self.dims is not None

    def prepared(self, model: nn.Module) -> bool:
        """True when this run prepared `model` already."""
        return model in self.models


def run_of(owner: Any) -> Run | None:
    """The Run of a trainer or accelerator (None: one mindspeed_hf did not set up)."""
    return vars(owner).get(_ATTRIBUTE) if hasattr(owner, "__dict__") else None


def attach(owner: Any, run: Run) -> Run:
    """Keep `run` on `owner` (the one attribute mindspeed_hf sets on a Trainer or Accelerator)."""
    setattr(owner, _ATTRIBUTE, run)
    return run


def resolve_config(args: Any) -> ResolvedConfig:
    """The accelerator config for a trainer: its arguments (set mindspeed_* fields, fsdp_config,
    parallelism_config) over the process config - a config given to enable(), else the MINDSPEED_HF_*
    variables, MINDSPEED_HF_CONFIG and the accelerate launch environment (precedence: mindspeed_hf.config)."""
    return resolve_for(args, base=apply.explicit_process_config())
