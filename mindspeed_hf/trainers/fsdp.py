"""FSDP2 inside transformers.Trainer: the accelerator builds the mesh and shards the model itself.

Plain Trainer hands FSDP to accelerate, which on CPU silently falls back to DDP and refuses DTensor parameters
on any multi-device run. So when FSDP is asked for (TrainingArguments `fsdp` + `fsdp_config` version 2, the
environment `accelerate launch` exports for an FSDP2 config, or non-default mindspeed_hf parallel sizes):

1. `resolve_plan` (fsdp_plan.py) reads every source once, before any work, and fails on contradictions;
2. `shard_model` (in the trainer's prepare hook) builds ParallelDims + mesh and applies FSDP2;
3. the `OVERRIDES` below replace the Trainer methods that would wrap the model again or save/load it as one
   tensor per parameter: the accelerator is created without accelerate's FSDP plugin (and on CPU told the real
   world size), Trainer takes its "model already sharded" path (`is_distributed_loading_by_transformers`), and
   checkpoints are atomic DCP directories (`parallel.save_sharded`).

MindSpeedTrainer and the wiring of plain Trainer both call `dispatch`, so there is one implementation.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import parallel
from ..device import detect_device_type
from ..parallel.checkpoint import COMPLETE_MARKER, STAGING_SUFFIX
from .fsdp_plan import FsdpPlan, resolve_plan, world_size_from

__all__ = ["FsdpPlan", "FsdpState", "dispatch", "resolve_plan", "shard_model"]

logger = logging.getLogger("mindspeed_hf")
# Environment switches that make accelerate build its own FSDP plugin / mesh (masked while our accelerator is made).
_ACCELERATE_SWITCHES = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG")


@dataclass
class FsdpState:
    """What was built for one trainer's model."""

    plan: FsdpPlan
    dims: parallel.ParallelDims
    mesh: Any
    device_type: str


# ---------------------------------------------------------------------------------------------- sharding
def _any_rank(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t)
    return bool(t.item())


def _low_precision(args: Any) -> torch.dtype | None:
    mixed = getattr(args, "mixed_precision", None) or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(mixed).lower())


def _broadcast_from_rank0(model: nn.Module, full: dict[str, torch.Tensor] | None, device: torch.device) -> None:
    """cpu_ram_efficient_loading: only rank 0 loaded the weights (the others hold meta/empty tensors)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        model.to_empty(device=device)
    set_model_state_dict(model, full or {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buffer in model.buffers():  # non-persistent buffers (rotary inv_freq) are not in any state dict
        dist.broadcast(buffer.data, src=0)


def shard_model(trainer: Any, model: nn.Module) -> nn.Module:
    """Init the process group, build the mesh and shard `model` in place with FSDP2 (collective)."""
    plan: FsdpPlan = trainer._mindspeed_fsdp_plan
    device_type = detect_device_type()
    device = parallel.init_distributed(device_type)
    dims = parallel.ParallelDims(plan.dp_replicate, plan.dp_shard, plan.cp, plan.ep, world_size=dist.get_world_size())
    mesh = dims.build_mesh(device_type)
    if plan.activation_checkpointing and not trainer._mindspeed_config.memory.recompute:
        from ..memory import enable_recompute

        enable_recompute(model)
    param_dtype = _low_precision(trainer._mindspeed_args)
    if param_dtype is not None:  # sharded master weights stay fp32; FSDP casts them for compute
        for p in model.parameters():
            if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
    sync = plan.cpu_ram_efficient_loading or _any_rank(any(p.is_meta for p in model.parameters()), device)
    full = model.state_dict() if sync and dist.get_rank() == 0 else None
    parallel.apply_fsdp(model, parallel.fsdp_mesh(mesh, dims), param_dtype=param_dtype, reduce_dtype=torch.float32,
                        reshard_after_forward=plan.reshard_after_forward, cpu_offload=plan.cpu_offload,
                        prefetch=plan.prefetch, layer_classes=plan.layer_classes)
    if sync:
        _broadcast_from_rank0(model, full, device)
    # transformers' own FSDP2 marker: generate() then keeps the ranks in step (synced_gpus), and Trainer's
    # gradient-accumulation path defers the reduction (see _defer_reduction).
    for module in {id(m): m for m in (model, parallel.unwrap_hf_model(model))}.values():
        module._is_fsdp_managed_module = True
    if callable(getattr(model, "generate", None)):
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model, "generate")
    trainer._mindspeed_fsdp = FsdpState(plan, dims, mesh, device_type)
    logger.info("mindspeed_hf: FSDP2 on %s (requested by %s): dp_replicate=%d dp_shard=%d, reshard_after_forward=%s,"
                " cpu_offload=%s, param dtype %s", device_type, "; ".join(plan.sources), dims.dp_replicate,
                dims.dp_shard, plan.reshard_after_forward, plan.cpu_offload, param_dtype or "as stored")
    return model


def check_after_init(trainer: Any) -> None:
    """Once Trainer.__init__ is done: take Trainer's "already sharded" path; refuse a pre-built optimizer."""
    if getattr(trainer, "_mindspeed_fsdp_plan", None) is None:
        return
    if trainer.optimizer is not None or trainer.lr_scheduler is not None:
        raise ValueError("mindspeed_hf FSDP2: `optimizers` passed to Trainer were built on the unsharded "
                         "parameters; let Trainer create them (or override create_optimizer)")
    # The model owns placement and gradient reduction: Trainer must not hand it to DDP or to accelerate's FSDP.
    trainer.is_distributed_loading_by_transformers = True


# ---------------------------------------------------------------------------------------------- accelerate
def _align_accelerate_state(args: Any) -> None:
    """On CPU accelerate counts torchrun's processes only with use_cpu; without that each rank would train on
    the whole batch alone. Set it and redo the device setup (the process group itself is kept)."""
    world = world_size_from(os.environ)
    if world <= 1 or args.world_size == world:
        return
    if detect_device_type() != "cpu":
        raise RuntimeError(f"mindspeed_hf FSDP2: accelerate sees {args.world_size} process(es), torch.distributed "
                           f"{world}")
    args.use_cpu = True
    args.__dict__.pop("_setup_devices", None)  # a cached_property: recompute it
    args._setup_devices  # noqa: B018
    if args.world_size != world:
        raise RuntimeError(f"mindspeed_hf FSDP2: accelerate still sees {args.world_size} processes, not {world}")


def _create_accelerator(trainer: Any, original: Callable[[], None]) -> None:
    """Create the accelerator without accelerate's FSDP plugin / ParallelismConfig (we shard ourselves)."""
    from accelerate.state import AcceleratorState

    args = trainer.args
    _align_accelerate_state(args)
    saved_env = {k: os.environ.pop(k) for k in _ACCELERATE_SWITCHES if k in os.environ}
    saved_args = args.fsdp_plugin_args, args.parallelism_config
    args.fsdp_plugin_args, args.parallelism_config = None, None
    shared = AcceleratorState._shared_state
    if shared.get("fsdp_plugin") is not None or shared.get("parallelism_config") is not None:
        AcceleratorState._reset_state()  # an earlier Accelerator fixed FSDP in the shared state
    try:
        original()
    finally:
        os.environ.update(saved_env)
        args.fsdp_plugin_args, args.parallelism_config = saved_args


# ---------------------------------------------------------------------------------------------- checkpoints
def _plain_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    from accelerate.optimizer import AcceleratedOptimizer

    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _checked(path: str) -> str:
    path = os.path.normpath(str(path))
    if not parallel.is_complete_checkpoint(path):
        raise ValueError(f"{path!r} is not a complete mindspeed_hf FSDP checkpoint (no {COMPLETE_MARKER} marker: "
                         "an interrupted save, or not written under FSDP); resume_from_checkpoint=True picks the "
                         "newest complete one")
    return path


def resolve_resume(trainer: Any, resume: Any) -> Any:
    """resume_from_checkpoint=True -> the newest COMPLETE checkpoint (interrupted saves are skipped)."""
    if resume is True:
        found = parallel.latest_complete_checkpoint(trainer.args.output_dir)
        if found is None:
            raise ValueError(f"No complete checkpoint (with a {COMPLETE_MARKER} marker) in {trainer.args.output_dir}")
        return found
    return _checked(resume) if resume else resume


def _save_checkpoint(trainer: Any, original: Callable, model: nn.Module, trial: Any = None) -> None:
    """Trainer._save_checkpoint as one atomic sharded directory: model + optimizer shards (DCP), scheduler,
    scaler, per-rank RNG, trainer state and args are staged in `<dir>.tmp`, which is renamed into place last."""
    from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints

    args, state = trainer.args, trainer.state
    if trainer.hp_search_backend is None and trial is None:
        trainer.store_flos()
    run_dir = trainer._get_output_dir(trial=trial)
    final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    staging = final + STAGING_SUFFIX
    resumable = not args.save_only_model
    stateful = {"scheduler": trainer.lr_scheduler, "scaler": getattr(trainer.accelerator, "scaler", None)}
    extra = {k: v.state_dict() for k, v in stateful.items() if resumable and v is not None}
    parallel.save_sharded(trainer.model, _plain_optimizer(trainer.optimizer) if resumable else None, extra, staging)
    if resumable:
        trainer._save_rng_state(staging)  # rng_state_<rank>.pth, read back by Trainer._load_rng_state
    if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and state.best_global_step:
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
        if os.path.exists(best):
            state.best_model_checkpoint = best
    if args.should_save:
        for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control] if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(state.stateful_callbacks[name], list):
                state.stateful_callbacks[name].append(cb.state())
            else:
                state.stateful_callbacks[name] = cb.state()
        state.save_to_json(os.path.join(staging, TRAINER_STATE_NAME))
        torch.save(args, os.path.join(staging, TRAINING_ARGS_NAME))
    dist.barrier()
    if dist.get_rank() == 0:  # publish: the finished directory appears in one rename
        if os.path.exists(final):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(final, COMPLETE_MARKER))
            shutil.rmtree(final)
        os.replace(staging, final)
    dist.barrier()
    if args.push_to_hub:
        trainer._push_from_checkpoint(final)
    if args.should_save:
        rotate_checkpoints(output_dir=run_dir, save_total_limit=args.save_total_limit,
                           best_model_checkpoint=state.best_model_checkpoint, use_mtime=True)


def load_model(trainer: Any, path: str) -> None:
    """Model shards from a checkpoint (collective); keeps its extra state for the optimizer/scheduler load."""
    path = _checked(path)
    trainer._mindspeed_resume_extra = (path, parallel.load_sharded(trainer.model, None, path))


def _load_optimizer_and_scheduler(trainer: Any, original: Callable, checkpoint: str | None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    if checkpoint is None:
        return
    path = _checked(checkpoint)
    stashed = getattr(trainer, "_mindspeed_resume_extra", None)
    extra = stashed[1] if stashed and stashed[0] == path else parallel.load_sharded(trainer.model, None, path)
    if "scheduler" not in extra:  # saved with save_only_model: nothing to resume (as in Trainer)
        return
    optimizer = _plain_optimizer(trainer.optimizer)
    state = {"optim": get_optimizer_state_dict(trainer.model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(trainer.model, optimizer, state["optim"])
    trainer.lr_scheduler.load_state_dict(extra["scheduler"])
    scaler = getattr(trainer.accelerator, "scaler", None)
    if scaler is not None and "scaler" in extra:
        scaler.load_state_dict(extra["scaler"])


def _save_model(trainer: Any, original: Callable, output_dir: str | None = None, _internal_call: bool = False) -> None:
    """A directory `from_pretrained` loads (PEFT: the adapter only), gathered to rank 0's host memory."""
    from transformers.trainer import TRAINING_ARGS_NAME

    output_dir = output_dir or trainer.args.output_dir
    parallel.save_hf_consolidated(trainer.model, output_dir)
    if trainer.args.should_save:
        processor = trainer.processing_class or getattr(trainer.data_collator, "tokenizer", None)
        if processor is not None:
            processor.save_pretrained(output_dir)
        torch.save(trainer.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
    if trainer.args.push_to_hub and not _internal_call:
        trainer.push_to_hub(commit_message="Model save", revision=trainer.args.hub_revision)


# ---------------------------------------------------------------------------------------------- the rest
def _evaluation_loop(trainer: Any, original: Callable, *args: Any, **kwargs: Any) -> Any:
    """Evaluation forwards leave the tail/root groups gathered (no backward follows): give the memory back."""
    try:
        return original(*args, **kwargs)
    finally:
        parallel.reshard_model(trainer.model)


def _move_model_to_device(trainer: Any, original: Callable, model: nn.Module, device: Any) -> None:
    """A sharded model owns its placement (a `.to()` would undo cpu_offload)."""
    if getattr(trainer, "_mindspeed_fsdp", None) is None:
        original(model, device)


@contextlib.contextmanager
def _defer_reduction(trainer: Any, original: Callable) -> Iterator[None]:
    """Gradient accumulation: no reduction until the last micro-batch (Trainer's own version reads a
    transformers DistributedConfig that our model does not have)."""
    model, dims = trainer.model, trainer._mindspeed_fsdp.dims
    if dims.dp_replicate > 1 and dims.fsdp_size > 1:  # HSDP: reduce-scatter now, all-reduce at the last one
        model.set_requires_all_reduce(False)
    else:
        model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


#: Trainer method name -> implementation(trainer, bound original, *args, **kwargs), used while FSDP is requested.
OVERRIDES: dict[str, Callable[..., Any]] = {
    "create_accelerator_and_postprocess": _create_accelerator,
    "_move_model_to_device": _move_model_to_device,
    "_defer_fsdp_gradient_reduction": _defer_reduction,
    "evaluation_loop": _evaluation_loop,
    "_save_checkpoint": _save_checkpoint,
    "_load_from_checkpoint": lambda trainer, original, path, model=None: load_model(trainer, path),
    "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler,
    "_load_best_model": lambda trainer, original: load_model(trainer, trainer.state.best_model_checkpoint),
    "save_model": _save_model,
}


def is_requested(trainer: Any) -> bool:
    return getattr(trainer, "_mindspeed_fsdp_plan", None) is not None


def dispatch(trainer: Any, name: str, original: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run OVERRIDES[name] when this trainer shards with FSDP2, else Trainer's own `original` (bound)."""
    if is_requested(trainer):
        return OVERRIDES[name](trainer, original, *args, **kwargs)
    return original(*args, **kwargs)


def resolve_train_call(trainer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """train(resume_from_checkpoint=...) with True/paths checked against the COMPLETE marker."""
    if not is_requested(trainer):
        return args, kwargs
    if args:
        return (resolve_resume(trainer, args[0]), *args[1:]), kwargs
    if "resume_from_checkpoint" in kwargs:
        kwargs = {**kwargs, "resume_from_checkpoint": resolve_resume(trainer, kwargs["resume_from_checkpoint"])}
    return args, kwargs
