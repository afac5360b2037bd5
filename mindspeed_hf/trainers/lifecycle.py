"""The trainer lifecycle, once: what a wired Trainer (plain, TRL's SFTTrainer, MindSpeedTrainer, any subclass) does
at each point of its life. wiring.py calls these from Trainer's own methods; nothing else runs them.

- `start` (first thing in __init__): the trainer's Run - its config resolved once, contradictions refused, the
  parallel plan read from every source of the request - before anything is patched or built;
- `prepare_model` (before Trainer sees the model): kernels attached, then `parallel.parallelize` (recompute, the mesh
  and each axis's step); under DDP / DeepSpeed a multimodal model's towers kept in step over the ranks;
- `after_init`: the checks that need Trainer's own state, and the step callback of `moe.balance`;
- `during_train` (around train()): the hang watch, Liger's patching kept off a model we accelerate, and the kernels
  watched.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from torch import nn
from transformers import TrainerCallback

from .. import runtime
from ..checkpoints import background
from ..patches import apply
from ..releases import seams
from ..runtime import Run, attach, elastic, resolve_config, run_of, watch, watchdog
from . import context, deepspeed, frameworks, fsdp
from .notices import release_ddp_notice

__all__ = ["after_init", "during_train", "is_accelerated", "prepare_model", "start"]

logger = logging.getLogger("mindspeed_hf")


def start(trainer: Any, args: Any) -> Run:
    """The trainer's Run, before Trainer.__init__: its config resolved (once; overrides logged once), DeepSpeed's
    exclusivity and Liger's checked, and the parallel plan read. Contradictions fail here, before any work. Once per
    trainer: MindSpeedTrainer starts its run before it wires Trainer, and the wired __init__ then finds it."""
    existing = run_of(trainer)
    if existing is not None and existing.args is args:
        return existing
    resolved = resolve_config(args)
    resolved.log_overrides()
    elastic.check_launcher()  # a launch whose restarts cannot work: say so once
    deepspeed.check_exclusive(args, resolved)  # DeepSpeed shards the model itself: not with our FSDP2 / CP / EP / TP
    if getattr(args, "use_liger_kernel", False) and not seams.available("apply_liger_kernel"):
        import transformers

        raise ValueError(f"use_liger_kernel=True: transformers {transformers.__version__} applies Liger inside "
                         "Trainer.__init__, over mindspeed_hf's kernels; choose one: use_liger_kernel=False, or "
                         "MINDSPEED_HF_AUTO=0 to use Liger alone")
    run = attach(trainer, Run(args=args, resolved=resolved, plan=runtime.resolve_plan(args, resolved),
                              param_dtype=runtime.low_precision(getattr(args, "mixed_precision", None))))
    release_ddp_notice(args, sharded=run.plan is not None)
    return run


def prepare_model(trainer: Any, model: nn.Module) -> nn.Module:
    """The model Trainer should use: prepared once through the runtime's one path (runtime/prepare.py: kernels,
    the mesh, each axis's step, the MoE aids); its accelerator's prepare then finds it prepared."""
    return runtime.prepare_model(run_of(trainer), model)


def is_accelerated(trainer: Any) -> bool:
    """True when our kernels run on the trainer's model (then Liger must stay out of it)."""
    run = run_of(trainer)
    return bool(run and run.report and any(run.report.get("kernels", {}).values()))


def after_init(trainer: Any) -> None:
    """Checks once Trainer.__init__ is done: FSDP2 takeover; no compute_metrics evaluation under cp; the fine-tuning
    framework driving the trainer and any of its kernel options that replaced ours (one line); say once that Liger's
    patching is off for our model; with moe.balance on, the callback that updates the expert biases after every
    optimizer step."""
    fsdp.check_after_init(trainer)
    context.check_metrics_at_init(trainer)
    frameworks.log_once(trainer, logger)
    run = run_of(trainer)
    if run.config.moe.balance != "none":  # the biases move after every optimizer step
        trainer.add_callback(BalanceCallback(lambda: run.moe_balance))
    if getattr(trainer.args, "use_liger_kernel", False) and is_accelerated(trainer):
        logger.warning(
            "mindspeed_hf: use_liger_kernel=True, but mindspeed_hf already accelerates this model; Liger's "
            "patching is skipped for it so the two do not patch the same layers (evaluation still passes "
            "skip_logits, which the accelerated forward accepts). Set MINDSPEED_HF_AUTO=0 to use Liger instead."
        )


@contextlib.contextmanager
def during_train(trainer: Any) -> Iterator[None]:
    """Around Trainer.train: the hang watch of a multi-process run (runtime/watchdog.py); Liger's patching kept off
    a model we accelerate; afterwards, one warning for each patched kernel that never ran, and the last checkpoint's
    background export waited for."""
    run = run_of(trainer)
    if run is not None:  # the step a hung rank's line names: read from the trainer's state (no callback of ours)
        watchdog.arm(run.config.parallel.collective_timeout, step_of=lambda: trainer.state.global_step + 1)
    try:
        with _liger_guard(trainer), _watch_kernels(trainer):
            yield
    finally:
        watchdog.disarm()
    if run is not None and run.export is not None:
        background.finish(run.export)
        run.export = None


@contextlib.contextmanager
def _watch_kernels(trainer: Any) -> Iterator[None]:
    """Afterwards, one warning when a kernel patched into the trainer's model never ran during train()
    (report()["ran"] did not move), naming the cause when it is known: a trainer whose compute_loss computes the loss
    itself, or code that replaced our kernels."""
    before = watch.snapshot(trainer.model) if getattr(trainer, "model", None) is not None else None
    if before is None or not is_accelerated(trainer):
        yield
        return
    yield
    if getattr(trainer.args, "torch_compile", False):  # a compiled graph runs no Python: nothing could count there
        logger.info("mindspeed_hf: torch_compile=True: the kernels ran inside the compiled graph, where they are not "
                    "counted (report()['ran'] counts eager forwards only)")
        return
    idle, replaced = watch.idle_kernels(trainer.model, before)
    if idle:
        logger.warning("mindspeed_hf: %s patched into %s but never ran during train()%s", ", ".join(idle),
                       type(apply.find_hf_model(trainer.model)).__name__, _idle_cause(trainer, idle, replaced))
    watch.say_fallbacks(trainer.model, before, "during train()")


def _idle_cause(trainer: Any, idle: list[str], replaced: dict[str, str]) -> str:
    """Why patched kernels did not run, where it is known (empty when not)."""
    from transformers import Trainer

    causes = []
    owner = next(c for c in type(trainer).__mro__ if "compute_loss" in vars(c))
    heads = frameworks.head_notes(trainer.model) if "fused_linear_cross_entropy" in idle else []
    if heads:  # a loss head installed on the model after Trainer.__init__ (TRL's), named as what ran instead
        causes.extend(heads)
    elif "fused_linear_cross_entropy" in idle and owner is not Trainer:
        causes.append(f"{owner.__module__}.{owner.__qualname__}.compute_loss computes the loss itself, so the "
                      "fused loss is not reached")
    if replaced:
        causes.append("replaced by other code: " + ", ".join(sorted(replaced)))
    return (": " + "; ".join(causes)) if causes else ""


@contextlib.contextmanager
def _liger_guard(trainer: Any) -> Iterator[None]:
    """Trainer calls `apply_liger_kernel` by its name in transformers.trainer; make that a no-op for a model we
    accelerate."""
    import transformers.trainer as hf_trainer

    current = getattr(hf_trainer, "apply_liger_kernel", None)
    if current is None or not getattr(trainer.args, "use_liger_kernel", False) or not is_accelerated(trainer):
        yield
        return

    def apply_liger_kernel(model: nn.Module, kernel_config: Any = None) -> None:
        logger.info("mindspeed_hf: skipping Liger's patching of %s (already accelerated)", type(model).__name__)

    hf_trainer.apply_liger_kernel = apply_liger_kernel
    try:
        yield
    finally:
        hf_trainer.apply_liger_kernel = current


class BalanceCallback(TrainerCallback):
    """Runs the trainer's balance step after every optimizer step (reads it from the trainer's Run each time: a
    model re-initialised by model_init gets its own)."""

    def __init__(self, balance_of) -> None:
        self._balance_of = balance_of

    def on_step_end(self, args, state, control, **kwargs):
        balance = self._balance_of()
        if balance is not None:
            balance.step()
