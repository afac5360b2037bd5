"""The wiring: after `import mindspeed_hf`, every `transformers.Trainer` (plain, TRL's SFTTrainer, MindSpeedTrainer,
any subclass) runs mindspeed_hf's lifecycle (lifecycle.py) from its own methods. It is the only mechanism:
MindSpeedTrainer adds no lifecycle of its own.

The methods are wrapped on the Trainer class object itself, not by rebinding the name `Trainer` in modules:
a script that did `from transformers import Trainer` before importing mindspeed_hf holds the same class
object, so it is covered too. Every original is kept and put back exactly by uninstall_trainer_wiring().
Settings for such a script come from its own `fsdp`/`fsdp_config`/`parallelism_config` arguments over the process
config (MINDSPEED_HF_* variables, MINDSPEED_HF_CONFIG=path.yaml, the accelerate launch environment, the defaults);
the Trainer methods in fsdp.OVERRIDES (each a seam, seams.py) are wrapped too and run ours while the model is
sharded; Trainer.log adds the MoE expert load to the training loss's log (moe/load.py); Trainer.get_train_dataloader
sizes batches in tokens when data.max_tokens_per_batch is set (batching.py). TrainingArguments.__post_init__
is wrapped for DeepSpeed
(trainers/deepspeed.py: the refusal of our parallelism with it, and deepspeed.comm before a ZeRO-3 model is built).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from ..moe import with_load
from ..patches import scope
from ..patches.engine import PatchSet
from ..releases import seams
from ..runtime import run_of
from . import batching, fsdp, lifecycle, starting
from .arguments_wiring import install_arguments_wiring, one_line_if_uncaught, uninstall_arguments_wiring
from .context import split_inputs

_patches = PatchSet()


def _wrap_init(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Find `model` and `args` however the caller passed them (positionally or by keyword).
        bound = signature.bind(self, *args, **kwargs)
        with one_line_if_uncaught():
            lifecycle.start(self, bound.arguments.get("args"))
            model = bound.arguments.get("model")
            if model is not None:
                bound.arguments["model"] = lifecycle.prepare_model(self, model)
        original(*bound.args, **bound.kwargs)
        with one_line_if_uncaught():
            lifecycle.after_init(self)

    return __init__


def _wrap_call_model_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def call_model_init(self, *args: Any, **kwargs: Any):
        """`model_init` models (also the re-init at train()) get the same preparation."""
        model = original(self, *args, **kwargs)
        return model if run_of(self) is None else lifecycle.prepare_model(self, model)

    return call_model_init


def _wrap_create_accelerator(original: Callable) -> Callable:
    @functools.wraps(original)
    def create_accelerator_and_postprocess(self, *args: Any, **kwargs: Any) -> None:
        """The trainer's accelerator adopts the trainer's Run (trainers/fsdp.py create_accelerator)."""
        if run_of(self) is None:  # made before the wiring was installed: left alone
            return original(self, *args, **kwargs)
        return fsdp.create_accelerator(self, functools.partial(original, self, *args, **kwargs))

    return create_accelerator_and_postprocess


def _wrap_train(original: Callable) -> Callable:
    @functools.wraps(original)
    def train(self, *args: Any, **kwargs: Any):
        args, kwargs = starting.resolve_train_call(self, args, kwargs)
        with lifecycle.during_train(self):
            return original(self, *args, **kwargs)

    return train


def _reads_only_the_loss(trainer: Any, model: Any, return_outputs: bool) -> bool:
    """True when Trainer.compute_loss's own body will use nothing of the model's outputs but the loss: no
    return_outputs, no compute_loss_func, no past_index, and a model whose forward does not read its inner
    model's logits (an HF model, or a PEFT model that is not prompt learning: CPT computes its loss from them)."""
    if return_outputs or getattr(trainer, "compute_loss_func", None) is not None:
        return False
    if getattr(trainer.args, "past_index", -1) >= 0:
        return False
    from transformers import PreTrainedModel

    inner = _unwrapped(trainer, model)
    peft_config = getattr(inner, "active_peft_config", None)  # read per call: the active adapter may change
    if peft_config is not None:
        return not getattr(peft_config, "is_prompt_learning", False)
    return isinstance(inner, PreTrainedModel)


def _unwrapped(trainer: Any, model: Any) -> Any:
    """accelerate's unwrap_model of `model`, once per model object: it reads package metadata on every call
    (is_deepspeed_available), which cost a tenth of a small model's training step."""
    known = trainer.__dict__.get("_mindspeed_unwrapped")
    if known is None or known[0] is not model:
        inner = trainer.accelerator.unwrap_model(model) if getattr(trainer, "accelerator", None) else model
        known = trainer.__dict__["_mindspeed_unwrapped"] = (model, inner)
    return known[1]


def _split_for_cp(bound: inspect.BoundArguments) -> None:
    """Context parallelism: compute_loss gets this rank's share of the batch (trainers/context.py)."""
    args = bound.arguments
    args["inputs"], num_items = split_inputs(args.get("model"), args["inputs"], args.get("num_items_in_batch"))
    if num_items is not None:
        args["num_items_in_batch"] = num_items


def _wrap_compute_loss(original: Callable) -> Callable:
    """Trainer.compute_loss inside scope.logits_unread_window when its outputs cannot reach anybody but the loss
    (so `kernels.skip_logits: auto` skips the logits there and nowhere else)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        _split_for_cp(bound)
        if not _reads_only_the_loss(self, bound.arguments.get("model"), bound.arguments.get("return_outputs", False)):
            return original(*bound.args, **bound.kwargs)
        with scope.logits_unread_window():
            return original(*bound.args, **bound.kwargs)

    return compute_loss


def _wrap_fsdp(name: str) -> Callable[[Callable], Callable]:
    """Trainer.<name> -> fsdp.OVERRIDES[name] while this trainer shards with FSDP2 (checkpoints.PLAIN for the
    checkpoint methods of every run); otherwise the original."""

    def wrap(original: Callable) -> Callable:
        @functools.wraps(original)
        def method(self, *args: Any, **kwargs: Any) -> Any:
            return fsdp.dispatch(self, name, functools.partial(original, self), *args, **kwargs)

        return method

    return wrap


def _wrap_log(original: Callable) -> Callable:
    """Trainer.log: the training loss's log gets the MoE expert load of its interval (moe/load.py)."""

    @functools.wraps(original)
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        run = run_of(self)
        load = run.moe_load if run else None
        return original(self, with_load(logs, load, self.state.global_step), *args, **kwargs)

    return log


def _wrap_train_dataloader(original: Callable) -> Callable:
    """Trainer.get_train_dataloader: batches sized by data.max_tokens_per_batch when it is set (batching.py)."""

    @functools.wraps(original)
    def get_train_dataloader(self, *args: Any, **kwargs: Any) -> Any:
        return batching.train_dataloader(self, functools.partial(original, self, *args, **kwargs))

    return get_train_dataloader


def _wrappers() -> dict[str, Callable[[Callable], Callable]]:
    wrappers: dict[str, Callable[[Callable], Callable]] = {
        "__init__": _wrap_init,
        "call_model_init": _wrap_call_model_init,
        "create_accelerator_and_postprocess": _wrap_create_accelerator,
        "train": _wrap_train,
        "compute_loss": _wrap_compute_loss,
        "log": _wrap_log,
        "get_train_dataloader": _wrap_train_dataloader,
    }
    wrappers.update({name: _wrap_fsdp(name) for name in fsdp.OVERRIDES})
    return wrappers


def install_trainer_wiring(checked: bool = False) -> None:
    """Wrap transformers.Trainer's __init__, call_model_init, train and the FSDP2 methods on the class, and
    TrainingArguments.__post_init__ (DeepSpeed). Idempotent. Fails (RuntimeError naming the transformers release)
    when a method we depend on is gone; `checked`: the caller has just found none gone (seams.problems())."""
    if len(_patches):
        return
    from transformers import Trainer, TrainingArguments

    if not checked:
        seams.check()
    for name, wrap in _wrappers().items():
        if name not in vars(Trainer):  # a seam newer than this release (seams.check() vouched for the rest)
            continue
        wrapped = wrap(vars(Trainer)[name])
        wrapped._mindspeed_wiring = True
        _patches.set(Trainer, name, wrapped)
    install_arguments_wiring(TrainingArguments)


def uninstall_trainer_wiring() -> None:
    """Put Trainer's (and TrainingArguments') original methods back (the exact function objects). Idempotent."""
    _patches.restore_all()
    uninstall_arguments_wiring()


def is_installed() -> bool:
    """True while transformers.Trainer is wired."""
    return bool(len(_patches))
