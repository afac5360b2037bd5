"""MindSpeedTrainer: transformers.Trainer that accelerates the model it is given.

The model is settled BEFORE Trainer.__init__ runs, because Trainer's __init__ already inspects it (loss kwargs,
label names), moves it to the device and builds the accelerator around it. `_mindspeed_prepare_model` is the
one hook that does it: the trainer's config attached to the model (kernels), then `parallel.parallelize`
(recompute, and when asked for the device mesh and FSDP2 sharding).

The helpers below only use attributes they set themselves (`_mindspeed_*`) and Trainer's public ones, so the
drop-in wiring (wiring.py) runs exactly the same code on a plain `transformers.Trainer` or TRL's SFTTrainer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from torch import nn
from transformers import Trainer, TrainingArguments

from ..config import MindSpeedConfig, ResolvedConfig
from ..memory.recompute import absorb_hf_checkpointing
from ..parallel.parallelize import ParallelizeOptions, parallelize
from ..patches import apply, scope
from . import deepspeed, frameworks, fsdp, seams
from .arguments import resolve_for
from .context import split_inputs
from .enabling import enable
from .wiring import release_ddp_notice

logger = logging.getLogger("mindspeed_hf")


def resolve_config(args: TrainingArguments | None) -> ResolvedConfig:
    """The accelerator config for a trainer: its arguments (set mindspeed_* fields, fsdp_config,
    parallelism_config) over the process config - a config given to enable(), else the MINDSPEED_HF_*
    variables, MINDSPEED_HF_CONFIG and the accelerate launch environment (precedence: mindspeed_hf.config)."""
    return resolve_for(args, base=apply.explicit_process_config())


def mindspeed_setup(trainer: Trainer, args: TrainingArguments | None) -> MindSpeedConfig:
    """Resolve the config of `trainer` (before Trainer.__init__): it belongs to this trainer and its model, not
    to the process. Contradictions fail here, before anything is patched or built."""
    resolved = resolve_config(args)
    resolved.log_overrides()  # once per trainer (the resolution itself is shared with the arguments' validation)
    deepspeed.check_exclusive(args, resolved)  # DeepSpeed shards the model itself: not with our FSDP2 / CP / EP / TP
    if getattr(args, "use_liger_kernel", False) and not seams.available("apply_liger_kernel"):
        import transformers

        raise ValueError(f"use_liger_kernel=True: transformers {transformers.__version__} applies Liger inside "
                         "Trainer.__init__, over mindspeed_hf's kernels; choose one: use_liger_kernel=False, or "
                         "MINDSPEED_HF_AUTO=0 to use Liger alone")
    # FSDP2 request from the args, the accelerate launch environment or the config.
    trainer._mindspeed_fsdp_plan = fsdp.resolve_plan(args, resolved)
    release_ddp_notice(args, sharded=trainer._mindspeed_fsdp_plan is not None)
    trainer._mindspeed_fsdp = None
    if not apply.is_enabled():  # the kernels are patched in once per process; settings stay per model
        enable()
    trainer._mindspeed_config = resolved.config
    # Trainer.__init__ has not run yet when the hook runs: keep the arguments where the hook can read them.
    trainer._mindspeed_args = args
    trainer._mindspeed_report = None
    return resolved.config


def prepare_model(trainer: Trainer, model: nn.Module) -> nn.Module:
    """Attach the trainer's config to `model` (PEFT-wrapped too) and run `parallelize` on it (recompute, and the
    mesh + FSDP2 when asked for); record and log what applied."""
    config: MindSpeedConfig = trainer._mindspeed_config
    report = apply.apply_to_model(model, config)
    trainer._mindspeed_report = report
    applied = [op for op, n in report.get("kernels", {}).items() if n]
    logger.info("mindspeed_hf: %s runs %s with kernels %s (backend %s); recompute %s", type(trainer).__name__,
                type(model).__name__, ", ".join(applied) or "none", report.get("backend"),
                _recompute_state(model, config))
    plan = trainer._mindspeed_fsdp_plan
    dims = fsdp.build_dims(trainer) if plan is not None else None
    options = ParallelizeOptions(param_dtype=fsdp.low_precision(trainer._mindspeed_args) if dims else None,
                                 layer_classes=plan.layer_classes if plan else None,
                                 broadcast_from_rank0=bool(plan and plan.cpu_ram_efficient_loading))
    model = parallelize(model, dims, config, options)
    absorb_hf_checkpointing(model, trainer._mindspeed_args, config.memory)  # applied: Trainer.train must not again
    if dims is not None:
        fsdp.log_sharded(trainer)
    return model


def _recompute_state(model: nn.Module, config: MindSpeedConfig) -> str:
    """What recomputes on `model`: ours (memory.recompute), HF's checkpointing switched on the model itself (as
    LLaMA-Factory does before it builds the Trainer), or nothing."""
    if config.memory.recompute:
        return f"on ({config.memory.recompute_mode})"
    hf_model = apply.find_hf_model(model)
    if getattr(hf_model, "is_gradient_checkpointing", False):
        return "on (Hugging Face gradient checkpointing, switched on the model)"
    return "off"


@contextlib.contextmanager
def watch_kernels(trainer: Trainer) -> Iterator[None]:
    """Around train(): afterwards, one warning when a kernel patched into the trainer's model never ran during it
    (report()["ran"] did not move), naming the cause when it is known: a trainer whose compute_loss computes the loss
    itself, or code that replaced our kernels. Re-entrant (MindSpeedTrainer under the wiring)."""
    hf_model = apply.find_hf_model(trainer.model) if getattr(trainer, "model", None) is not None else None
    if hf_model is None or getattr(trainer, "_mindspeed_watching", False) or not is_accelerated(trainer):
        yield
        return
    before = dict(scope.ran(hf_model))
    trainer._mindspeed_watching = True
    try:
        yield
    finally:
        trainer._mindspeed_watching = False
    result = apply.report(trainer.model)
    replaced = apply.replacements(trainer.model)
    on = {op for op, n in result["kernels"].items() if n} | set(replaced.values())
    idle = [op for op in result["kernels"] if op in on and result["ran"].get(op, 0) == before.get(op, 0)]
    if idle:
        logger.warning("mindspeed_hf: %s patched into %s but never ran during train()%s", ", ".join(idle),
                       type(hf_model).__name__, _idle_cause(trainer, idle, replaced))


def _idle_cause(trainer: Trainer, idle: list[str], replaced: dict[str, str]) -> str:
    """Why patched kernels did not run, where it is known (empty when not)."""
    causes = []
    owner = next(c for c in type(trainer).__mro__ if "compute_loss" in vars(c))
    if "fused_linear_cross_entropy" in idle and owner not in (Trainer, MindSpeedTrainer):
        causes.append(f"{owner.__module__}.{owner.__qualname__}.compute_loss computes the loss itself, so the "
                      "fused loss is not reached")
    if replaced:
        causes.append("replaced by other code: " + ", ".join(sorted(replaced)))
    return (": " + "; ".join(causes)) if causes else ""


def is_accelerated(trainer: Trainer) -> bool:
    """True when our kernels run on the trainer's model (then Liger must stay out of it)."""
    report = getattr(trainer, "_mindspeed_report", None)
    return bool(report and any(report.get("kernels", {}).values()))


def after_init(trainer: Trainer) -> None:
    """Checks once Trainer.__init__ is done: FSDP2 takeover; the fine-tuning framework driving the trainer and any
    of its kernel options that replaced ours (one line); say once that Liger's patching is off for our model."""
    fsdp.check_after_init(trainer)
    frameworks.log_once(trainer, logger)
    if getattr(trainer.args, "use_liger_kernel", False) and is_accelerated(trainer):
        logger.warning(
            "mindspeed_hf: use_liger_kernel=True, but mindspeed_hf already accelerates this model; Liger's "
            "patching is skipped for it so the two do not patch the same layers (evaluation still passes "
            "skip_logits, which the accelerated forward accepts). Set MINDSPEED_HF_AUTO=0 to use Liger instead."
        )


@contextlib.contextmanager
def liger_guard(trainer: Trainer) -> Iterator[None]:
    """During train(): Trainer calls `apply_liger_kernel` by its name in transformers.trainer; make that a no-op
    for a model we accelerate. Re-entrant (MindSpeedTrainer under the wiring enters it twice)."""
    import transformers.trainer as hf_trainer

    current = getattr(hf_trainer, "apply_liger_kernel", None)
    if (current is None or getattr(current, "_mindspeed_guard", False)
            or not getattr(trainer.args, "use_liger_kernel", False) or not is_accelerated(trainer)):
        yield
        return

    def apply_liger_kernel(model: nn.Module, kernel_config: Any = None) -> None:
        logger.info("mindspeed_hf: skipping Liger's patching of %s (already accelerated)", type(model).__name__)

    apply_liger_kernel._mindspeed_guard = True
    hf_trainer.apply_liger_kernel = apply_liger_kernel
    try:
        yield
    finally:
        hf_trainer.apply_liger_kernel = current


class MindSpeedTrainer(Trainer):
    """transformers.Trainer that runs the model on mindspeed_hf's fused kernels and, when asked for, FSDP2.

    Takes every Trainer argument. The config comes from MindSpeedTrainingArguments over the process config
    (mindspeed_hf.config gives the precedence) and belongs to this trainer and its model: other trainers and
    models in the process keep theirs. Using this class is an explicit request: it patches the kernels in even
    under MINDSPEED_HF_AUTO=0.
    """

    # The drop-in wiring of transformers.Trainer leaves instances of this class to their own code.
    _mindspeed_managed = True

    def __init__(self, model: nn.Module | None = None, args: TrainingArguments | None = None, *rest: Any,
                 **kwargs: Any) -> None:
        mindspeed_setup(self, args)
        if model is not None:
            model = self._mindspeed_prepare_model(model)
        super().__init__(model, args, *rest, **kwargs)
        after_init(self)

    def _mindspeed_prepare_model(self, model: nn.Module) -> nn.Module:
        """The one hook that settles the model before Trainer sees it: kernels, recompute, mesh and FSDP2
        sharding. Returns the model Trainer should use."""
        return prepare_model(self, model)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """`model_init` models (also the re-init at train()) get the same preparation."""
        return self._mindspeed_prepare_model(super().call_model_init(trial))

    def train(self, *args: Any, **kwargs: Any):
        """Trainer.train with Liger's patching kept off a model mindspeed_hf accelerates (and, under FSDP2,
        resume_from_checkpoint checked against the COMPLETE marker)."""
        args, kwargs = fsdp.resolve_train_call(self, args, kwargs)
        with liger_guard(self), watch_kernels(self):
            return super().train(*args, **kwargs)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        """Trainer.compute_loss on this rank's share of the batch under context parallelism (trainers/context.py)."""
        inputs, num_items_in_batch = split_inputs(model, inputs, num_items_in_batch)
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch, **kwargs)

    @property
    def mindspeed_report(self) -> dict[str, Any] | None:
        """report() of the model as prepared (None before a model was given)."""
        return self._mindspeed_report


def _fsdp_method(name: str) -> Any:
    """MindSpeedTrainer.<name>: fsdp.OVERRIDES[name] while FSDP2 is requested, else Trainer's own method."""

    def method(self: MindSpeedTrainer, *args: Any, **kwargs: Any) -> Any:
        return fsdp.dispatch(self, name, getattr(super(MindSpeedTrainer, self), name), *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Trainer.{name}, replaced by mindspeed_hf.trainers.fsdp while the model is FSDP2-sharded."
    return method


for _name in fsdp.OVERRIDES:
    if hasattr(Trainer, _name):  # a seam newer than the installed release is not used
        setattr(MindSpeedTrainer, _name, _fsdp_method(_name))
