"""A sharded model inside transformers.Trainer: what is Trainer's own around the runtime's one path.

Plain Trainer hands FSDP to accelerate, which on CPU silently falls back to DDP and refuses DTensor parameters
on any multi-device run. So when sharding is asked for (runtime/plan.py reads every source of the request, before
any work), the model is prepared through the runtime (runtime/prepare.py: the mesh, `parallel.parallelize`) and the
trainer's accelerator, made through the accelerate seam (runtime/accelerator.py) with the trainer's own Run, keeps it
as it is. Trainer's own code then runs with our pieces around it, through the seams listed in seams.py:

- the accelerator is created from arguments without an FSDP plugin (and on CPU told the real world size);
- checkpoints are Trainer's own `_save_checkpoint` (trainer state, RNG, scaler, rotation, best model), made
  atomic by checkpoints.py as for every run: the model and optimizer go in as DCP shards (`pytorch_model_fsdp_0/`,
  `optimizer_0/`, accelerate's names), the COMPLETE marker once every rank is done, rotation after it; resume and
  best-model loading read the shards back.

The wiring of Trainer's methods (every Trainer, MindSpeedTrainer included) calls `dispatch`.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from .. import parallel, runtime
from ..checkpoints.layout import MODEL_DIR, OPTIMIZER_DIR, check_checkpoint
from ..device import detect_device_type
from ..releases import seams
from ..runtime import run_of
from ..runtime.plan import world_size_from
from ..runtime.state import save_configs
from . import checkpoints, context

__all__ = ["create_accelerator", "dispatch"]

logger = logging.getLogger("mindspeed_hf")


# ---------------------------------------------------------------------------------------------- Trainer's state
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
        # which Trainer refuses optimizer checkpoints; older releases get the same from the
        # accelerate seam's prepare_model, which keeps a sharded model as it is.
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


def create_accelerator(trainer: Any, original: Callable[[], None]) -> None:
    """Trainer's accelerator, made through the accelerate seam (runtime/accelerator.py) with the trainer's own Run.
    For a trainer we shard, its arguments hold no FSDP plugin / ParallelismConfig while it is made (their settings
    are in the run's config: we shard) and on CPU its device setup counts every process; the arguments are given
    back afterwards, so the copy saved in checkpoints is the user's."""
    run = run_of(trainer)
    if run.plan is None:
        with runtime.adopting(run):
            original()
        return
    args = trainer.args
    masked = [name for name in ("fsdp_plugin_args", "parallelism_config") if name in vars(args)]  # 4.57: no plugin
    saved_args = {name: vars(args)[name] for name in masked}
    for name in masked:
        setattr(args, name, None)
    try:
        with _world_visible_to_accelerate(args), runtime.adopting(run):
            original()
    finally:
        for name, value in saved_args.items():
            setattr(args, name, value)


# ---------------------------------------------------------------------------------------------- checkpoints
def _plain_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    from accelerate.optimizer import AcceleratedOptimizer

    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


@contextlib.contextmanager
def _weights_already_written(model: nn.Module, checkpoint: bool) -> Iterator[None]:
    """While Trainer's save_model runs: the model's `save_pretrained` (what Trainer's `_save` writes the weights
    with, every release) writes no weights (written already, collectively); in a checkpoint it writes the configs
    beside the shards (`_save_configs`). The rest of Trainer's save - processor, training arguments, push_to_hub -
    is its own."""
    own = vars(model).get("save_pretrained")
    model.save_pretrained = lambda save_directory, *args, **kwargs: (
        save_configs(model, save_directory) if checkpoint else None)
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
    parallel.load_model_shards(trainer.model, os.path.join(check_checkpoint(path, sharded=True), MODEL_DIR))


def _load_optimizer_and_scheduler(trainer: Any, original: Callable, checkpoint: str | None) -> None:
    from transformers.trainer import SCHEDULER_NAME

    if checkpoint is None:
        return
    path = check_checkpoint(checkpoint, sharded=True)
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
