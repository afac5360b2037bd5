"""Drop-in wiring: after `import mindspeed_hf`, a plain `transformers.Trainer` (and every subclass, TRL's
SFTTrainer included) behaves like MindSpeedTrainer.

The methods are wrapped on the Trainer class object itself, not by rebinding the name `Trainer` in modules:
a script that did `from transformers import Trainer` before importing mindspeed_hf holds the same class
object, so it is covered too. Every original is kept and put back exactly by uninstall_trainer_wiring().
Settings for such a script come from its own `fsdp`/`fsdp_config`/`parallelism_config` arguments over the process
config (MINDSPEED_HF_* variables, MINDSPEED_HF_CONFIG=path.yaml, the accelerate launch environment, the defaults);
the Trainer methods in fsdp.OVERRIDES (each a seam, seams.py) are wrapped too and run the same code as
MindSpeedTrainer's while the model is sharded. TrainingArguments.__post_init__ is wrapped for DeepSpeed
(trainers/deepspeed.py: the refusal of our parallelism with it, and deepspeed.comm before a ZeRO-3 model is built).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from ..patches.engine import PatchSet

_patches = PatchSet()


def _managed(trainer: Any) -> bool:
    """MindSpeedTrainer does its own preparation; the wrappers leave it alone so nothing runs twice."""
    return getattr(type(trainer), "_mindspeed_managed", False)


def _wrap_init(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if _managed(self):
            return original(self, *args, **kwargs)
        from .trainer import MindSpeedTrainer, after_init, mindspeed_setup

        # Find `model` and `args` however the caller passed them (positionally or by keyword).
        bound = signature.bind(self, *args, **kwargs)
        mindspeed_setup(self, bound.arguments.get("args"))
        model = bound.arguments.get("model")
        if model is not None:
            # The same hook as MindSpeedTrainer's, so future mesh/FSDP steps reach plain Trainers as well.
            bound.arguments["model"] = MindSpeedTrainer._mindspeed_prepare_model(self, model)
        original(*bound.args, **bound.kwargs)
        after_init(self)

    return __init__


def _wrap_call_model_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def call_model_init(self, *args: Any, **kwargs: Any):
        model = original(self, *args, **kwargs)
        if _managed(self) or not hasattr(self, "_mindspeed_config"):
            return model
        from .trainer import MindSpeedTrainer

        return MindSpeedTrainer._mindspeed_prepare_model(self, model)

    return call_model_init


def _wrap_train(original: Callable) -> Callable:
    @functools.wraps(original)
    def train(self, *args: Any, **kwargs: Any):
        from . import fsdp
        from .trainer import liger_guard, watch_kernels

        if not _managed(self):
            args, kwargs = fsdp.resolve_train_call(self, args, kwargs)
        with liger_guard(self), watch_kernels(self):
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

    inner = trainer.accelerator.unwrap_model(model) if getattr(trainer, "accelerator", None) else model
    peft_config = getattr(inner, "active_peft_config", None)
    if peft_config is not None:
        return not getattr(peft_config, "is_prompt_learning", False)
    return isinstance(inner, PreTrainedModel)


def _split_for_cp(bound: inspect.BoundArguments) -> None:
    """Context parallelism: compute_loss gets this rank's share of the batch (trainers/context.py)."""
    from .context import split_inputs

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
        from ..patches import scope

        with scope.logits_unread_window():
            return original(*bound.args, **bound.kwargs)

    return compute_loss


def _wrap_fsdp(name: str) -> Callable[[Callable], Callable]:
    """Trainer.<name> -> fsdp.OVERRIDES[name] while this trainer shards with FSDP2 (the same code MindSpeedTrainer
    runs); otherwise, and for MindSpeedTrainer's own calls through super(), the original."""

    def wrap(original: Callable) -> Callable:
        @functools.wraps(original)
        def method(self, *args: Any, **kwargs: Any) -> Any:
            from . import fsdp

            if _managed(self):
                return original(self, *args, **kwargs)
            return fsdp.dispatch(self, name, functools.partial(original, self), *args, **kwargs)

        return method

    return wrap


def _wrappers() -> dict[str, Callable[[Callable], Callable]]:
    from .fsdp import OVERRIDES

    wrappers: dict[str, Callable[[Callable], Callable]] = {
        "__init__": _wrap_init,
        "call_model_init": _wrap_call_model_init,
        "train": _wrap_train,
        "compute_loss": _wrap_compute_loss,
    }
    wrappers.update({name: _wrap_fsdp(name) for name in OVERRIDES})
    return wrappers


def _wrap_arguments_post_init(original: Callable) -> Callable:
    """TrainingArguments.__post_init__ with the DeepSpeed steps around it (trainers/deepspeed.py): use_cpu for a
    CPU multi-process run before the devices are set up; afterwards the refusal of our parallelism with DeepSpeed
    and deepspeed.comm initialised, so a ZeRO-3 model built next under zero.Init is partitioned over every rank."""

    @functools.wraps(original)
    def __post_init__(self) -> None:
        from . import deepspeed
        from .fsdp_plan import ddp_notice_held

        deepspeed.before_arguments(self)
        with ddp_notice_held() as notice:  # released once the trainer knows whether we shard (release_ddp_notice)
            original(self)
        HELD_NOTICES[id(self)] = notice
        deepspeed.after_arguments(self)

    return __post_init__


#: id(TrainingArguments) -> transformers' DDP notice held while they were built.
HELD_NOTICES: dict[int, Any] = {}


def release_ddp_notice(args: Any, sharded: bool) -> None:
    """transformers' DDP notice for these arguments: printed when we do not shard the model, dropped when we do."""
    notice = HELD_NOTICES.pop(id(args), None)
    if notice is not None:
        notice.release(sharded)


def install_trainer_wiring() -> None:
    """Wrap transformers.Trainer's __init__, call_model_init, train and the FSDP2 methods on the class, and
    TrainingArguments.__post_init__ (DeepSpeed). Idempotent. Fails (RuntimeError naming the transformers release)
    when a method we depend on is gone."""
    if len(_patches):
        return
    from transformers import Trainer, TrainingArguments

    from . import seams

    seams.check()
    for name, wrap in _wrappers().items():
        if name not in vars(Trainer):  # a seam newer than this release (seams.check() vouched for the rest)
            continue
        wrapped = wrap(vars(Trainer)[name])
        wrapped._mindspeed_wiring = True
        _patches.set(Trainer, name, wrapped)
    post_init = _wrap_arguments_post_init(vars(TrainingArguments)["__post_init__"])
    post_init._mindspeed_wiring = True
    _patches.set(TrainingArguments, "__post_init__", post_init)


def uninstall_trainer_wiring() -> None:
    """Put Trainer's original methods back (the exact function objects). Idempotent."""
    _patches.restore_all()


def is_installed() -> bool:
    """True while transformers.Trainer is wired."""
    return bool(len(_patches))
