"""The trainer lifecycle, once: what a wired Trainer (plain, TRL's SFTTrainer, MindSpeedTrainer, any subclass) does
at each point of its life. wiring.py calls these from Trainer's own methods; nothing else runs them.

- `start` (first thing in __init__): the trainer's Run - its config resolved once, contradictions refused, the
  parallel plan read from every source of the request - before anything is patched or built;
- `prepare_model` (before Trainer sees the model): kernels attached, then `parallel.parallelize` (recompute, the mesh
  and each axis's step); under DDP / DeepSpeed a multimodal model's towers kept in step over the ranks;
- `after_init`: the checks that need Trainer's own state, and the step callback of `moe.balance`;
- `during_train` (around train()): Liger's patching kept off a model we accelerate, and the kernels watched.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..device import detect_device_type, local_rank
from ..memory.recompute import absorb_hf_checkpointing
from ..parallel.parallelize import ParallelizeOptions, parallelize
from ..parallel.towers import keep_media_in_step, tower_modules
from ..patches import apply, scope
from . import context, deepspeed, export_background, frameworks, fsdp, seams
from .fsdp_plan import release_ddp_notice
from .moe_balance import AuxFreeBalance, BalanceCallback
from .moe_load import ExpertLoad
from .run import Run, attach, resolve_config, run_of

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
    deepspeed.check_exclusive(args, resolved)  # DeepSpeed shards the model itself: not with our FSDP2 / CP / EP / TP
    if getattr(args, "use_liger_kernel", False) and not seams.available("apply_liger_kernel"):
        import transformers

        raise ValueError(f"use_liger_kernel=True: transformers {transformers.__version__} applies Liger inside "
                         "Trainer.__init__, over mindspeed_hf's kernels; choose one: use_liger_kernel=False, or "
                         "MINDSPEED_HF_AUTO=0 to use Liger alone")
    run = attach(trainer, Run(args=args, resolved=resolved, plan=fsdp.resolve_plan(args, resolved)))
    release_ddp_notice(args, sharded=run.plan is not None)
    return run


def prepare_model(trainer: Any, model: nn.Module) -> nn.Module:
    """Attach the trainer's config to `model` (PEFT-wrapped too) and run `parallelize` on it (recompute, and the
    mesh + each axis's step when asked for); record and log what applied. Returns the model Trainer should use."""
    run = run_of(trainer)
    run.report = apply.apply_to_model(model, run.config)
    applied = [op for op, n in run.report.get("kernels", {}).items() if n]
    logger.info("mindspeed_hf: %s runs %s with kernels %s (backend %s); recompute %s", type(trainer).__name__,
                type(model).__name__, ", ".join(applied) or "none", run.report.get("backend"),
                _recompute_state(model, run.config))
    dims = fsdp.build_dims(run) if run.plan is not None else None
    options = ParallelizeOptions(param_dtype=fsdp.low_precision(run.args) if dims else None,
                                 layer_classes=run.plan.layer_classes if run.plan else None,
                                 broadcast_from_rank0=bool(run.plan and run.plan.cpu_ram_efficient_loading))
    model = parallelize(model, dims, run.config, options)
    if dims is None:  # data parallelism we do not shard: DDP, DeepSpeed (our FSDP2 steps keep the towers in step)
        _keep_towers_in_step(model)
    absorb_hf_checkpointing(model, run.args, run.config.memory)  # applied: Trainer.train must not again
    for previous in (run.moe_load, run.moe_balance):  # a model given again (model_init's re-init at train())
        if previous is not None:
            previous.remove()
    history = (os.path.join(run.args.output_dir, ExpertLoad.HISTORY)
               if getattr(run.args, "process_index", 0) == 0 and getattr(run.args, "output_dir", None) else None)
    run.moe_load = ExpertLoad.attach(model, history) if run.config.moe.log_load else None
    run.moe_balance = AuxFreeBalance.attach(model, run.config)
    if dims is not None:
        fsdp.log_sharded(run)
    return model


def _keep_towers_in_step(model: nn.Module) -> None:
    """On more than one rank without our FSDP2 (Trainer's DDP, DeepSpeed ZeRO), a rank whose rows lack a medium
    another rank has would still skip collectives of that tower: DDP's gradient reduction (it hangs without
    find_unused_parameters, which gradient checkpointing turns off), ZeRO-1/2's gradient buckets, ZeRO-3's weight
    gathers. parallel/towers.py's placeholders keep those ranks in step, as under our FSDP2."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    hf_model = apply.find_hf_model(model)
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and tower_modules(hf_model)):
        return
    # the flags' all-gather runs where the backend does
    device = torch.device("cpu") if dist.get_backend() == "gloo" else torch.device(detect_device_type(), local_rank())
    # ZeRO-3 gathers weights in every forward, DDP and ZeRO-1/2 reduce gradients only
    installed = keep_media_in_step(model, hf_model, device, gradients_only=not is_deepspeed_zero3_enabled())
    if installed is not None:
        logger.info("mindspeed_hf: %d ranks train %s: the ranks' media compared each step; %s",
                    dist.get_world_size(), type(hf_model).__name__,
                    "a rank lacking a medium another rank has runs that tower on a placeholder"
                    if installed == "placeholders" else "different media stop the step in one line")


def _recompute_state(model: nn.Module, config: Any) -> str:
    """What recomputes on `model`: ours (memory.recompute), HF's checkpointing switched on the model itself (as
    LLaMA-Factory does before it builds the Trainer), or nothing."""
    if config.memory.recompute:
        return f"on ({config.memory.recompute_mode})"
    hf_model = apply.find_hf_model(model)
    if getattr(hf_model, "is_gradient_checkpointing", False):
        return "on (Hugging Face gradient checkpointing, switched on the model)"
    return "off"


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
    """Around Trainer.train: Liger's patching kept off a model we accelerate; afterwards, one warning for each
    patched kernel that never ran, and the last checkpoint's background export waited for."""
    with _liger_guard(trainer), _watch_kernels(trainer):
        yield
    run = run_of(trainer)
    if run is not None and run.export is not None:
        export_background.finish(run.export)
        run.export = None


@contextlib.contextmanager
def _watch_kernels(trainer: Any) -> Iterator[None]:
    """Afterwards, one warning when a kernel patched into the trainer's model never ran during train()
    (report()["ran"] did not move), naming the cause when it is known: a trainer whose compute_loss computes the loss
    itself, or code that replaced our kernels."""
    hf_model = apply.find_hf_model(trainer.model) if getattr(trainer, "model", None) is not None else None
    if hf_model is None or not is_accelerated(trainer):
        yield
        return
    before = dict(scope.ran(hf_model))
    yield
    if getattr(trainer.args, "torch_compile", False):  # a compiled graph runs no Python: nothing could count there
        logger.info("mindspeed_hf: torch_compile=True: the kernels ran inside the compiled graph, where they are not "
                    "counted (report()['ran'] counts eager forwards only)")
        return
    result = apply.report(trainer.model)
    replaced = apply.replacements(trainer.model)
    on = {op for op, n in result["kernels"].items() if n} | set(replaced.values())
    idle = [op for op in result["kernels"] if op in on and result["ran"].get(op, 0) == before.get(op, 0)]
    if idle:
        logger.warning("mindspeed_hf: %s patched into %s but never ran during train()%s", ", ".join(idle),
                       type(hf_model).__name__, _idle_cause(trainer, idle, replaced))


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
