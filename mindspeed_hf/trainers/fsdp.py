"""FSDP2 inside transformers.Trainer: the accelerator builds the mesh and shards the model itself.

Plain Trainer hands FSDP to accelerate, which on CPU silently falls back to DDP and refuses DTensor parameters
on any multi-device run. So when FSDP is asked for (fsdp_plan.py reads every source of the request, before any
work), the trainer's prepare hook builds ParallelDims + mesh (`build_dims`, kept in the trainer's Run) and
`parallel.parallelize` shards the
model. Trainer's own code then runs with our pieces around it, through the seams listed in seams.py:

- the accelerator is created without accelerate's FSDP plugin (and on CPU told the real world size), and keeps
  the sharded model as it is (no DDP, no second sharding);
- checkpoints are Trainer's own `_save_checkpoint` (trainer state, RNG, scaler, rotation, best model), made
  atomic by checkpoints.py as for every run: the model and optimizer go in as DCP shards (`pytorch_model_fsdp_0/`,
  `optimizer_0/`, accelerate's names), the COMPLETE marker once every rank is done, rotation after it; resume and
  best-model loading read the shards back.

The wiring of Trainer's methods (every Trainer, MindSpeedTrainer included) calls `dispatch`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from .. import parallel
from ..device import detect_device_type
from . import checkpoints, context, seams
from .fsdp_plan import FsdpPlan, resolve_plan, world_size_from
from .run import Run, run_of

__all__ = ["FsdpPlan", "build_dims", "dispatch", "resolve_plan"]

logger = logging.getLogger("mindspeed_hf")
# Environment switches that make accelerate build its own FSDP plugin / mesh (masked while our accelerator is made).
_ACCELERATE_SWITCHES = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG")
MODEL_DIR, OPTIMIZER_DIR = "pytorch_model_fsdp_0", "optimizer_0"


# ---------------------------------------------------------------------------------------------- sharding
def low_precision(args: Any) -> torch.dtype | None:
    """The run's bf16/fp16 mixed precision (TrainingArguments, or accelerate launch's environment)."""
    mixed = getattr(args, "mixed_precision", None) or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(mixed).lower())


def build_dims(run: Run) -> parallel.ParallelDims:
    """Init the process group and build the named mesh for the run's plan (collective); kept in the run."""
    run.device_type = detect_device_type()
    parallel.init_distributed(run.device_type)
    run.dims = run.plan.new_dims(dist.get_world_size())
    run.dims.build_mesh(run.device_type)
    return run.dims


def log_sharded(run: Run) -> None:
    """After parallelize: say what was built."""
    p = run.config.parallel
    dims = run.dims
    ep = f" ep={dims.ep} (efsdp={dims.efsdp_size})" if dims.ep_enabled else ""
    ep += f" tp={dims.tp}" if dims.tp_enabled else ""
    what = "FSDP2" if dims.dp_replicate * dims.fsdp_size > 1 else "tensor parallelism"
    if dims.tp_enabled and what == "FSDP2":
        what += " x tensor parallelism"
    logger.info("mindspeed_hf: %s on %s (requested by %s): dp_replicate=%d dp_shard=%d%s, reshard_after_forward=%s,"
                " cpu_offload=%s, param dtype %s", what, run.device_type, "; ".join(run.plan.sources),
                dims.dp_replicate, dims.dp_shard, ep, p.reshard_after_forward, p.cpu_offload,
                low_precision(run.args) or "as stored")


def check_after_init(trainer: Any) -> None:
    """Once Trainer.__init__ is done: refuse an optimizer built on the unsharded parameters, and (5.x) take
    Trainer's path for a model that owns its placement and gradient reduction."""
    if not is_requested(trainer):
        return
    if trainer.optimizer is not None or trainer.lr_scheduler is not None:
        raise ValueError("mindspeed_hf FSDP2: `optimizers` passed to Trainer were built on the unsharded "
                         "parameters; let Trainer create them (or override create_optimizer)")
    if seams.available("is_distributed_loading_by_transformers"):
        # Set on the trainer, after __init__: on the model it would also mean "sharded by from_pretrained", for
        # which Trainer refuses optimizer checkpoints; older releases get the same from _keep_sharded.
        trainer.is_distributed_loading_by_transformers = True


# ---------------------------------------------------------------------------------------------- accelerate
@contextlib.contextmanager
def _world_visible_to_accelerate(args: Any) -> Iterator[None]:
    """On CPU accelerate counts torchrun's processes only with use_cpu; without it each rank would train on the
    whole batch alone. Redo the device setup with it (the process group itself is kept), then give the user's
    value back, so the arguments saved in checkpoints are the ones they wrote."""
    world = world_size_from(os.environ)
    if world <= 1 or args.world_size == world:
        yield
        return
    if detect_device_type() != "cpu":
        raise RuntimeError(f"mindspeed_hf FSDP2: accelerate sees {args.world_size} process(es), torch.distributed "
                           f"{world}")
    given = args.use_cpu
    args.use_cpu = True
    args.__dict__.pop("_setup_devices", None)  # a cached_property: recompute it
    try:
        args._setup_devices  # noqa: B018
        if args.world_size != world:
            raise RuntimeError(f"mindspeed_hf FSDP2: accelerate still sees {args.world_size} processes, not {world}")
        yield
    finally:
        args.use_cpu = given


def _keep_sharded(prepare_model: Callable) -> Callable:
    """accelerator.prepare_model for a model we sharded: autocast / compile only, no DDP, no second sharding."""

    @functools.wraps(prepare_model)
    def prepare(model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        return prepare_model(model, device_placement=False, evaluation_mode=True)

    return prepare


def _create_accelerator(trainer: Any, original: Callable[[], None]) -> None:
    """Trainer's accelerator, created without accelerate's FSDP plugin / ParallelismConfig (their settings were
    read into the trainer's config already: we shard), and kept from wrapping the sharded model."""
    from accelerate.state import AcceleratorState

    args = trainer.args
    saved_env = {k: os.environ.pop(k) for k in _ACCELERATE_SWITCHES if k in os.environ}
    masked = [name for name in ("fsdp_plugin_args", "parallelism_config") if name in vars(args)]  # 4.57: no plugin
    saved_args = {name: vars(args)[name] for name in masked}
    for name in masked:
        setattr(args, name, None)
    shared = AcceleratorState._shared_state
    if shared.get("fsdp_plugin") is not None or shared.get("parallelism_config") is not None:
        AcceleratorState._reset_state()  # an earlier Accelerator fixed FSDP in the process-wide state
    try:
        with _world_visible_to_accelerate(args):
            original()
    finally:
        os.environ.update(saved_env)
        for name, value in saved_args.items():
            setattr(args, name, value)
    trainer.accelerator.prepare_model = _keep_sharded(trainer.accelerator.prepare_model)
    context.data_over_dp(trainer)  # context parallelism: batches split over dp only


# ---------------------------------------------------------------------------------------------- checkpoints
def _plain_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    from accelerate.optimizer import AcceleratedOptimizer

    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _save_configs(model: nn.Module, save_directory: str) -> None:
    """Beside a checkpoint's shards, what names the model: its config (with its architectures, as HF's
    save_pretrained sets them) and generation config, and a PEFT model's adapter configs - what
    `mindspeed-hf export` rebuilds the model from."""
    os.makedirs(save_directory, exist_ok=True)
    hf_model = parallel.unwrap_hf_model(model)
    # the model's own class, not the FSDP2 subclass fully_shard made (FSDP<Class>)
    own = next((c for c in type(hf_model).__mro__ if not issubclass(c, FSDPModule)), type(hf_model))
    hf_model.config.architectures = [own.__name__]
    hf_model.config.save_pretrained(save_directory)
    if getattr(hf_model, "generation_config", None) is not None and hf_model.can_generate():
        hf_model.generation_config.save_pretrained(save_directory)
    for name, config in (getattr(model, "peft_config", None) or {}).items():
        config.save_pretrained(save_directory if name == "default" else os.path.join(save_directory, name))


@contextlib.contextmanager
def _weights_already_written(model: nn.Module, checkpoint: bool) -> Iterator[None]:
    """While Trainer's save_model runs: the model's `save_pretrained` (what Trainer's `_save` writes the weights
    with, every release) writes no weights (written already, collectively); in a checkpoint it writes the configs
    beside the shards (`_save_configs`). The rest of Trainer's save - processor, training arguments, push_to_hub -
    is its own."""
    own = vars(model).get("save_pretrained")
    model.save_pretrained = lambda save_directory, *args, **kwargs: (
        _save_configs(model, save_directory) if checkpoint else None)
    try:
        yield
    finally:
        if own is None:
            del model.save_pretrained
        else:
            model.save_pretrained = own


def _save_model(trainer: Any, original: Callable, output_dir: str | None = None, _internal_call: bool = False) -> None:
    """The weights, on every rank: inside a checkpoint save this rank's model shards; otherwise a directory
    `from_pretrained` loads (PEFT: the adapter only), gathered to rank 0's host memory. Then Trainer's own
    save_model, which writes everything else (its weight writer made a no-op)."""
    output_dir = output_dir or trainer.args.output_dir
    checkpoint = checkpoints.begin_checkpoint_dir(trainer, output_dir)  # called by Trainer._save_checkpoint: staging
    if checkpoint:
        parallel.save_model_shards(trainer.model, os.path.join(output_dir, MODEL_DIR))
    else:
        parallel.save_hf_consolidated(trainer.model, output_dir)
    with _weights_already_written(trainer.model, checkpoint):
        original(output_dir, _internal_call=_internal_call)


def _save_optimizer_and_scheduler(trainer: Any, original: Callable, output_dir: str) -> None:
    """Optimizer shards (DCP) from every rank; the scheduler's state once, as Trainer writes it."""
    from transformers.trainer import SCHEDULER_NAME

    parallel.save_optimizer_shards(trainer.model, _plain_optimizer(trainer.optimizer),
                                   os.path.join(output_dir, OPTIMIZER_DIR))
    if trainer.args.should_save and trainer.lr_scheduler is not None:
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def load_model(trainer: Any, path: str) -> None:
    """Model shards from a complete checkpoint into the sharded model (collective)."""
    parallel.load_model_shards(trainer.model, os.path.join(checkpoints.check_checkpoint(path, sharded=True), MODEL_DIR))


def _load_optimizer_and_scheduler(trainer: Any, original: Callable, checkpoint: str | None) -> None:
    from transformers.trainer import SCHEDULER_NAME

    if checkpoint is None:
        return
    path = checkpoints.check_checkpoint(checkpoint, sharded=True)
    if not os.path.isdir(os.path.join(path, OPTIMIZER_DIR)):  # saved with save_only_model: nothing to resume
        return
    parallel.load_optimizer_shards(trainer.model, _plain_optimizer(trainer.optimizer),
                                   os.path.join(path, OPTIMIZER_DIR))
    scheduler = os.path.join(path, SCHEDULER_NAME)
    if os.path.isfile(scheduler):
        trainer.lr_scheduler.load_state_dict(torch.load(scheduler, map_location="cpu", weights_only=True))


# ---------------------------------------------------------------------------------------------- the rest
def _evaluation_loop(trainer: Any, original: Callable, *args: Any, **kwargs: Any) -> Any:
    """Predictions under cp are refused (context.check_predictions); evaluation forwards leave the tail/root groups
    gathered (no backward follows): give the memory back."""
    asked = inspect.signature(original).bind(*args, **kwargs).arguments.get("prediction_loss_only")
    context.check_predictions(trainer, loss_only=bool(trainer.args.prediction_loss_only if asked is None else asked))
    try:
        return original(*args, **kwargs)
    finally:
        parallel.reshard_model(trainer.model)


def _move_model_to_device(trainer: Any, original: Callable, model: nn.Module, device: Any) -> None:
    """A sharded model owns its placement (a `.to()` would undo cpu_offload)."""
    if not run_of(trainer).sharded:
        original(model, device)


def _defer_reduction(trainer: Any, original: Callable) -> contextlib.AbstractContextManager:
    """Gradient accumulation: no reduction until the last micro-batch (Trainer's own version reads the mesh from a
    transformers DistributedConfig that our model does not have)."""
    dims = run_of(trainer).dims
    if not isinstance(trainer.model, FSDPModule):  # tensor parallel alone: no reduction across data ranks
        return contextlib.nullcontext()
    return parallel.defer_gradient_reduction(trainer.model, hsdp=dims.dp_replicate > 1 and dims.fsdp_size > 1)


#: Trainer method name -> implementation(trainer, bound original, *args, **kwargs), used while FSDP is requested.
#: Every name is a seam (seams.py).
OVERRIDES: dict[str, Callable[..., Any]] = {
    "create_accelerator_and_postprocess": _create_accelerator,
    "_move_model_to_device": _move_model_to_device,
    "_defer_fsdp_gradient_reduction": _defer_reduction,
    "evaluation_loop": _evaluation_loop,
    "_save_checkpoint": checkpoints.save_checkpoint,
    "save_model": _save_model,
    "_save_optimizer_and_scheduler": _save_optimizer_and_scheduler,
    "_load_from_checkpoint": lambda trainer, original, path, model=None: load_model(trainer, path),
    "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler,
    "_load_best_model": lambda trainer, original: load_model(trainer, trainer.state.best_model_checkpoint),
}


def is_requested(trainer: Any) -> bool:
    """True when the trainer's Run has a parallel plan (the model is, or is being, sharded by us)."""
    run = run_of(trainer)
    return run is not None and run.plan is not None


def dispatch(trainer: Any, name: str, original: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run OVERRIDES[name] when this trainer shards with FSDP2, else checkpoints.PLAIN[name] (atomic checkpoints
    for every run mindspeed_hf set up) or Trainer's own `original` (bound)."""
    if run_of(trainer) is None:  # made before the wiring was installed: not set up by mindspeed_hf, left alone
        return original(*args, **kwargs)
    if is_requested(trainer):
        return OVERRIDES[name](trainer, original, *args, **kwargs)
    if name in checkpoints.PLAIN:
        return checkpoints.PLAIN[name](trainer, original, *args, **kwargs)
    return original(*args, **kwargs)


def resolve_train_call(trainer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """train(resume_from_checkpoint=...) settled for every run: True -> the newest complete checkpoint that reads,
    a path checked (COMPLETE marker, readable files); see checkpoints.resolve_resume."""
    sharded = is_requested(trainer)
    if args:
        return (checkpoints.resolve_resume(trainer, args[0], sharded), *args[1:]), kwargs
    if "resume_from_checkpoint" in kwargs:
        kwargs = {**kwargs, "resume_from_checkpoint": checkpoints.resolve_resume(
            trainer, kwargs["resume_from_checkpoint"], sharded)}
    return args, kwargs
