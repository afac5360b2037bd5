"""The accelerate seam: after `import mindspeed_hf`, every `accelerate.Accelerator` - a script's own (custom loops,
transformers' `*_no_trainer.py`, diffusers' training scripts) and the one a Trainer makes - prepares models through
mindspeed_hf's one path (runtime/prepare.py).

The methods are wrapped on the Accelerator class itself (every original kept; uninstall puts them back exactly):

- `__init__`: the accelerator's Run, before any work: its config resolved once (the `fsdp_plugin` /
  `parallelism_config` the script passed over MINDSPEED_HF_*, MINDSPEED_HF_CONFIG, the `accelerate launch`
  environment, the defaults; one-line errors as for a Trainer) and its parallel plan read. A Trainer's accelerator
  adopts the trainer's Run instead (`adopting`). With a plan, accelerate is made without its own FSDP plugin /
  ParallelismConfig (we shard), on CPU told the real world size, and the mesh is built right after;
- `prepare_model`: a model not yet prepared goes through `prepare_model(run, model)` (kernels, then tp, ep, cp,
  recompute, offload, FSDP2); a sharded one then gets accelerate's autocast only (no DDP, no second sharding);
- `prepare`: the optimizers the script built on the unsharded parameters are switched to the sharded ones (by
  parameter name); with `moe.balance` the expert biases move after every optimizer step;
- `_prepare_device_mesh`: data loaders split over the data-parallel ranks only: the ranks of a cp or tp group get
  the same batches (the model splits a batch's sequence itself: runtime/loop_cp.py);
- `clip_grad_norm_`, `get_state_dict`, `save_state` / `load_state` of a sharded run: gradients on several meshes,
  full state dicts gathered, DCP checkpoints complete or absent (runtime/state.py);
- `end_training` (or the end of the process): one line for each kernel patched into a prepared model that never ran.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import functools
import inspect
import logging
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import parallel
from ..config import resolve_for_accelerator
from ..device import detect_device_type
from ..errors import say_once_if_uncaught
from ..patches import apply, lazy_logits
from ..patches.engine import PatchSet
from ..value_kinds import parse_flag
from . import loop_watch, state, watch
from . import prepare as preparing
from .plan import resolve_plan, world_size_from
from .prepare import ensure_dims, low_precision
from .run import Run, attach, run_of

__all__ = ["adopting", "install_accelerator_wiring", "is_installed", "uninstall_accelerator_wiring"]

logger = logging.getLogger("mindspeed_hf")
_patches = PatchSet()
#: Environment switches that make accelerate build its own FSDP plugin / mesh (masked while our accelerator is made).
ACCELERATE_SWITCHES = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG")
#: Accelerator arguments that would make accelerate shard the model its own way (dropped when we shard).
_THEIR_SHARDING = ("fsdp_plugin", "parallelism_config", "torch_tp_plugin")
#: The Run of the Trainer whose accelerator is being made (it adopts that run instead of starting its own).
_ADOPTING: contextvars.ContextVar[Run | None] = contextvars.ContextVar("mindspeed_adopting", default=None)


@contextlib.contextmanager
def adopting(run: Run) -> Iterator[None]:
    """While a Trainer makes its accelerator: the accelerator takes the trainer's Run (one run per trainer)."""
    token = _ADOPTING.set(run)
    try:
        yield
    finally:
        _ADOPTING.reset(token)


# ---------------------------------------------------------------------------------------------- __init__
def _start(arguments: dict[str, Any]) -> Run:
    """A loop's Run: its config from the Accelerator's arguments over the process config, the plan, checked."""
    plugin, pc = arguments.get("fsdp_plugin"), arguments.get("parallelism_config")
    resolved = resolve_for_accelerator(plugin, pc, base=apply.explicit_process_config())
    resolved.log_overrides()
    plan = resolve_plan(None, resolved, fsdp_plugin=plugin, parallelism_config=pc)
    deepspeed = arguments.get("deepspeed_plugin") or arguments.get("deepspeed_plugins") or parse_flag(
        os.environ.get("ACCELERATE_USE_DEEPSPEED", "false"), "ACCELERATE_USE_DEEPSPEED")
    if plan is not None and deepspeed:
        raise ValueError(f"DeepSpeed cannot be combined with mindspeed_hf's parallelism ({'; '.join(plan.sources)}): "
                         "both shard the model; drop one (mindspeed_hf's kernels and fused loss run under DeepSpeed "
                         "either way)")
    mixed = arguments.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION")
    return Run(args=None, resolved=resolved, plan=plan, owner="Accelerator", param_dtype=low_precision(mixed))


@contextlib.contextmanager
def _accelerate_kept_from_sharding(arguments: dict[str, Any]) -> Iterator[None]:
    """While accelerate makes the accelerator of a run we shard: no FSDP plugin / ParallelismConfig of its own (their
    settings were read into the run's config), no process-wide state an earlier Accelerator left with one, and on CPU
    under a multi-process launcher every process counted (accelerate counts them only with `cpu=True`)."""
    from accelerate.state import AcceleratorState, PartialState

    for name in _THEIR_SHARDING:
        if name in arguments:
            arguments[name] = None
    saved_env = {k: os.environ.pop(k) for k in ACCELERATE_SWITCHES if k in os.environ}
    shared = AcceleratorState._shared_state
    if shared.get("fsdp_plugin") is not None or shared.get("parallelism_config") is not None:
        AcceleratorState._reset_state()
    world = world_size_from(os.environ)
    if world > 1 and detect_device_type() == "cpu":
        arguments["cpu"] = True
        if PartialState._shared_state and PartialState._shared_state.get("num_processes", world) != world:
            AcceleratorState._reset_state(reset_partial_state=True)  # set up earlier without the other processes
    try:
        yield
    finally:
        os.environ.update(saved_env)


def _wrap_init(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        try:
            run = _ADOPTING.get() or _start(bound.arguments)
        except ValueError as err:  # a mistake in the loop's settings: one line if nobody catches it
            say_once_if_uncaught(err)
            raise
        if run.plan is None:
            original(*bound.args, **bound.kwargs)
        else:
            with _accelerate_kept_from_sharding(bound.arguments):
                original(*bound.args, **bound.kwargs)
        attach(self, run)
        ensure_dims(run)  # the mesh now: a data loader prepared before the model splits over it already

    return __init__


# ---------------------------------------------------------------------------------------------- prepare
def _wrap_prepare_model(original: Callable) -> Callable:
    @functools.wraps(original)
    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        run = run_of(self)
        if run is None or getattr(model, "_is_accelerate_prepared", False):
            return original(self, model, device_placement, evaluation_mode)
        model = preparing.prepare_model(run, model)
        if run.sharded:  # ours: accelerate adds autocast only (no DDP, no second sharding, no .to())
            return original(self, model, device_placement=False, evaluation_mode=True)
        return original(self, model, device_placement, evaluation_mode)

    return prepare_model


def _named_parameters(objects: tuple) -> dict[int, dict[str, nn.Parameter]]:
    return {id(obj): dict(obj.named_parameters()) for obj in objects if isinstance(obj, nn.Module)}


def _plain_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's AcceleratedOptimizer (itself a torch Optimizer subclass)."""
    from accelerate.optimizer import AcceleratedOptimizer

    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _switch_optimizers(before: dict[int, dict[str, nn.Parameter]], objects: tuple, result: tuple,
                       unwrap: Callable[[nn.Module], nn.Module]) -> None:
    """Optimizers built on a model's parameters before sharding now update the sharded ones (by name)."""
    mapping: dict[int, nn.Parameter] = {}
    for old_model, new_model in zip(objects, result, strict=True):
        if id(old_model) not in before:
            continue
        now = dict(unwrap(new_model).named_parameters())
        for name, param in before[id(old_model)].items():
            new = now.get(name)
            if new is not None and new is not param:
                mapping[id(param)] = new
    if not mapping:
        return
    for obj in result:
        optimizer = _plain_optimizer(obj)
        if not isinstance(optimizer, torch.optim.Optimizer):
            continue
        stale = [p for group in optimizer.param_groups for p in group["params"] if id(p) in mapping]
        if stale and any(optimizer.state.get(p) for p in stale):
            raise ValueError("mindspeed_hf: the optimizer passed to Accelerator.prepare has state for the unsharded "
                             "parameters (it stepped before prepare); prepare the model and optimizer before training")
        for group in optimizer.param_groups:
            group["params"] = [mapping.get(id(p), p) for p in group["params"]]


def _wrap_prepare(original: Callable) -> Callable:
    @functools.wraps(original)
    def prepare(self, *args: Any, device_placement: list[bool] | None = None):
        run = run_of(self)
        if run is None:
            return original(self, *args, device_placement=device_placement)
        before = _named_parameters(args)
        result = original(self, *args, device_placement=device_placement)
        results = result if isinstance(result, tuple) else (result,)
        _switch_optimizers(before, args, results, functools.partial(self.unwrap_model, keep_torch_compile=False))
        if run.moe_balance is not None and run.args is None:  # a Trainer steps them from its callback
            for obj in results:
                _balance_after_steps(run, _plain_optimizer(obj))
        if any(isinstance(obj, nn.Module) for obj in args):
            _watch_at_exit(self, run)
        if run.args is None:  # a loop (a Trainer watches its own run): the hang watch, steps, restarts
            loop_watch.follow(self, run, results)
        return result

    return prepare


def _balance_after_steps(run: Run, optimizer: Any) -> None:
    """moe.balance=aux_free in a loop: the expert biases move after every optimizer step."""
    if not isinstance(optimizer, torch.optim.Optimizer) or getattr(optimizer, "_mindspeed_balance", False):
        return
    optimizer.register_step_post_hook(lambda *_: run.moe_balance is not None and run.moe_balance.step())
    optimizer._mindspeed_balance = True


def _wrap_device_mesh(original: Callable) -> Callable:
    @functools.wraps(original)
    def _prepare_device_mesh(self):
        """Data loaders over dp only when ranks of a cp or tp group must see the same batches (accelerate reads our
        world mesh by its axis names: dp_replicate, dp_shard, cp, tp)."""
        run = run_of(self)
        if run is not None and run.dims is not None and run.dims.same_batch_size > 1:
            return run.dims.world_mesh
        return original(self)

    return _prepare_device_mesh


# ---------------------------------------------------------------------------------------------- a sharded run's
def _ours(accelerator: Any) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """The accelerator's models we sharded and the optimizers that update them."""
    run = run_of(accelerator)
    if run is None or not run.sharded:
        return [], []
    models = [m for m in accelerator._models if run.prepared(m)]
    optimizers = [o for o in accelerator._optimizers if state.owner_of(_plain_optimizer(o), models) is not None]
    return models, optimizers


@contextlib.contextmanager
def _left_to_us(accelerator: Any, models: list[nn.Module], optimizers: list[Any]) -> Iterator[None]:
    """While accelerate's own save / load runs: our sharded models and their optimizers are not in its lists (we
    write and read them as shards), everything else is."""
    kept_models, kept_optimizers = accelerator._models, accelerator._optimizers
    accelerator._models = [m for m in kept_models if all(m is not o for o in models)]
    accelerator._optimizers = [o for o in kept_optimizers if all(o is not x for x in optimizers)]
    try:
        yield
    finally:
        accelerator._models, accelerator._optimizers = kept_models, kept_optimizers


def _wrap_save_state(original: Callable) -> Callable:
    @functools.wraps(original)
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any):
        models, optimizers = _ours(self)
        if not models:
            return original(self, output_dir, safe_serialization, **kwargs)
        written: list[str] = []

        def write_ours(_models: list, _weights: list, directory: str) -> None:
            state.begin(directory)
            state.write_shards(models, [_plain_optimizer(o) for o in optimizers], directory)
            written.append(directory)

        handle = self.register_save_state_pre_hook(write_ours)
        try:
            with _left_to_us(self, models, optimizers):
                location = original(self, output_dir, safe_serialization, **kwargs)
        finally:
            handle.remove()
        state.finish(written[0])
        return location

    return save_state


def _wrap_load_state(original: Callable) -> Callable:
    @functools.wraps(original)
    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any):
        models, optimizers = _ours(self)
        if not models:
            return original(self, input_dir, load_kwargs, **kwargs)
        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            input_dir = state.newest_complete(os.path.join(self.project_dir, "checkpoints"))
        if input_dir is not None:
            state.check_loadable(os.path.expanduser(input_dir))
        with _left_to_us(self, models, optimizers):
            result = original(self, input_dir, load_kwargs, **kwargs)
        state.read_shards(models, [_plain_optimizer(o) for o in optimizers], os.path.expanduser(input_dir))
        return result

    return load_state


def _wrap_get_state_dict(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_state_dict(self, model: nn.Module, unwrap: bool = True):
        """A sharded model's full state dict, gathered to rank 0's host memory (collective: every rank calls it)."""
        models, _ = _ours(self)
        if not any(model is m for m in models):
            return original(self, model, unwrap)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        parallel.reshard_model(model)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        first: dict[int, str] = {}  # tied parameters (lm_head and the embeddings) share one tensor, as unsharded
        for name, param in model.named_parameters(remove_duplicate=False):
            kept = first.setdefault(id(param), name)
            if kept != name and kept in full and name in full:
                full[name] = full[kept]
        return full

    return get_state_dict


def _wrap_clip_grad_norm(original: Callable) -> Callable:
    @functools.wraps(original)
    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2):
        """A sharded run's gradients live on several meshes (experts apart): their norm per mesh, combined."""
        if not _ours(self)[0]:
            return original(self, parameters, max_norm, norm_type)
        self.unscale_gradients()
        return parallel.clip_grad_norm_(list(parameters), max_norm, norm_type)

    return clip_grad_norm_


# ---------------------------------------------------------------------------------------------- what ran
def _check_kernels(accelerator: Any) -> None:
    """One line per prepared model whose patched kernels never ran since it was prepared (rank 0)."""
    run = run_of(accelerator)
    before = vars(accelerator).pop("_mindspeed_watch", None)
    if run is None or not before or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        return
    for model in list(run.models):
        counters = before.get(id(model))
        if counters is None:
            continue
        idle, replaced = watch.idle_kernels(model, counters)
        if idle:
            logger.warning("mindspeed_hf: %s patched into %s but never ran since Accelerator.prepare%s",
                           ", ".join(idle), type(apply.find_hf_model(model)).__name__,
                           _idle_cause(run, model, idle, replaced))
        watch.say_fallbacks(model, counters, "since Accelerator.prepare")


def _idle_cause(run: Run, model: nn.Module, idle: list[str], replaced: dict[str, str]) -> str:
    """Why patched kernels did not run in a loop, where it is known (empty when not)."""
    causes = []
    head = apply.find_hf_model(model).get_output_embeddings()
    if ("fused_linear_cross_entropy" in idle and run.config.kernels.skip_logits == "auto" and head is not None
            and not lazy_logits.can_defer(head)):
        causes.append("a loop may read the logits, and this lm_head (sharded around the forward) cannot make them "
                      "later, so the full logits were built; kernels.skip_logits: always runs the fused loss in "
                      "training forwards with labels (their logits are then not computed)")
    if replaced:
        causes.append("replaced by other code: " + ", ".join(sorted(replaced)))
    return (": " + "; ".join(causes)) if causes else ""


def _watch_at_exit(accelerator: Any, run: Run) -> None:
    """Take the prepared models' counters now; check them at end_training, else when the process ends (unless it
    ends on an uncaught error)."""
    watched = vars(accelerator).setdefault("_mindspeed_watch", {})
    for model in run.models:
        if id(model) not in watched:
            counters = watch.snapshot(model)
            if counters is not None:
                watched[id(model)] = counters
    if not vars(accelerator).get("_mindspeed_atexit"):
        accelerator._mindspeed_atexit = True
        ref = weakref.ref(accelerator)
        atexit.register(lambda: ref() is not None and not hasattr(sys, "last_value") and _check_kernels(ref()))


def _wrap_end_training(original: Callable) -> Callable:
    @functools.wraps(original)
    def end_training(self):
        _check_kernels(self)
        loop_watch.end()
        return original(self)

    return end_training


# ---------------------------------------------------------------------------------------------- install
_WRAPPERS: dict[str, Callable[[Callable], Callable]] = {
    "__init__": _wrap_init,
    "prepare": _wrap_prepare,
    "prepare_model": _wrap_prepare_model,
    "_prepare_device_mesh": _wrap_device_mesh,
    "clip_grad_norm_": _wrap_clip_grad_norm,
    "get_state_dict": _wrap_get_state_dict,
    "save_state": lambda original: loop_watch.while_saving(_wrap_save_state(original)),
    "load_state": lambda original: loop_watch.noting_load(_wrap_load_state(original)),
    "end_training": _wrap_end_training,
}


def install_accelerator_wiring() -> None:
    """Wrap accelerate.Accelerator's methods on the class (idempotent)."""
    if len(_patches):
        return
    from accelerate import Accelerator

    for name, wrap in _WRAPPERS.items():
        wrapped = wrap(vars(Accelerator)[name])
        wrapped._mindspeed_wiring = True
        _patches.set(Accelerator, name, wrapped)


def uninstall_accelerator_wiring() -> None:
    """Put Accelerator's original methods back (the exact function objects). Idempotent."""
    _patches.restore_all()


def is_installed() -> bool:
    return bool(len(_patches))
