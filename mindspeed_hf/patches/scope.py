"""Whose settings apply while a model runs: the config a trainer (or apply_to_model) gave that model.

The kernels are patched into model classes once, for the whole process, so two models of one class (a trained
policy and its frozen reference, two trainers in one notebook, an HPO sweep) share the patched code. What differs
is the config each was given: `attach(model, config)` keeps it on the model and makes it *current* while that
model runs (forward hooks on the model and its backbone; every decoder layer enters the scope itself, its fused
forward or HF's own wrapped in the same entry, so that a layer recomputed in backward by activation checkpointing
sees it too). Every patched function asks `current()` and runs HF's original code for an op that
config switches off. Code outside any attached model sees the process config.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..config import MindSpeedConfig
from ..ops import registry
from ..releases import compat
from . import choice
from .engine import PATCHES

_running: contextvars.ContextVar[MindSpeedConfig | None] = contextvars.ContextVar("mindspeed_hf_config", default=None)
_unread: contextvars.ContextVar[bool] = contextvars.ContextVar("mindspeed_hf_logits_unread", default=False)
_process: dict[str, MindSpeedConfig | None] = {"config": None}
# The running models' configs while torch.compile traces their forward (see current()).
_traced: list[MindSpeedConfig | None] = []
_unread_traced: list[bool] = []  # logits_unread_window's mirror for torch.compile


def set_process_config(config: MindSpeedConfig | None) -> None:
    """The config of models that were not given one (what enable() was called with)."""
    _process["config"] = config


def process_config() -> MindSpeedConfig | None:
    """The process config; None while the package is disabled."""
    return _process["config"]


def current() -> MindSpeedConfig:
    """The config of the model running now, else the process config, else the defaults. While torch.compile traces
    (it cannot trace a ContextVar) the running model's config is read from a plain stack the hooks keep then: the
    choice is made once, when the graph is built."""
    if torch.compiler.is_compiling():
        return (_traced[-1] if _traced else None) or _process["config"] or _DEFAULT
    return _running.get() or _process["config"] or _DEFAULT


_DEFAULT = MindSpeedConfig()
_ENTER = "_mindspeed_enter"  # a self-scoped decoder layer's scope entry (attach)


@contextlib.contextmanager
def logits_unread_window() -> Iterator[None]:
    """Inside: the caller will read nothing of the model's outputs but the loss (Trainer's own loss computation),
    so a fused loss may skip the logits under kernels.skip_logits=auto."""
    token = _unread.set(True)
    _unread_traced.append(True)
    try:
        yield
    finally:
        _unread_traced.pop()
        _unread.reset(token)


def logits_unread() -> bool:
    """True inside a logits_unread_window (while torch.compile traces: read from a plain mirror, which the graph is
    guarded on)."""
    return bool(_unread_traced) if torch.compiler.is_compiling() else _unread.get()


def kernel_on(op: str) -> bool:
    """True when the current config runs `op` (a KernelConfig switch name) on the fused kernel."""
    return bool(getattr(current().kernels, op))


def config_of(model: nn.Module) -> MindSpeedConfig:
    """The config attached to `model` (or the process one)."""
    return getattr(model, "_mindspeed_config", None) or _process["config"] or _DEFAULT


def _enter(config: MindSpeedConfig | None, counts: dict[str, int],
           ops: frozenset[str] = frozenset()) -> Callable[..., None]:
    """The pre-hook: `config` current (None: keep the current one; outside every scope, the process config as the
    model's `ops` choose, patches/choice.py) and the kernels that run counted into `counts`."""

    def hook(module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            _enter_traced(config if config is not None else _outermost(ops, compiling=True))
            return
        if _inside_scope(hook):
            # Already inside this model's scope (a layer's child run by its layer): nothing to set or reset.
            module.__dict__.setdefault("_mindspeed_tokens", []).append(())
            return
        running = config if config is not None else _outermost(ops)
        tokens = (registry.count_into(counts),) if running is None else (
            registry.count_into(counts), _running.set(running),
            registry.use_backend(None if running.backend == "auto" else running.backend))
        module.__dict__.setdefault("_mindspeed_tokens", []).append(tokens)

    hook._mindspeed_scope = True
    hook.config, hook.counts = config, counts
    return hook


def _outermost(ops: frozenset[str], compiling: bool = False) -> MindSpeedConfig | None:
    """For a model that follows the process config: the process config as its choices (`ops`) make it, when it runs
    outside every other model's scope and that changes something; else None (the current config stays)."""
    outer = (_traced[-1] if _traced else None) if compiling else _running.get()
    if not ops or outer is not None or _process["config"] is None:
        return None
    running = choice.running_config(_process["config"], ops)
    return None if running is _process["config"] else running


def _inside_scope(enter: Callable[..., None]) -> bool:
    """True when the scope an `_enter` hook sets is the current one already."""
    return registry.counter() is enter.counts and (enter.config is None or _running.get() is enter.config)


def _enter_traced(config: MindSpeedConfig | None) -> None:
    """The pre-hook while Dynamo traces it into a graph: the config for the trace (None: keep the running one),
    nothing counted."""
    _traced.append(config if config is not None else (_traced[-1] if _traced else None))
    registry.use_backend(registry.requested_backend() if config is None else  # None: the running one stays
                         None if config.backend == "auto" else config.backend)


def _leave(module: nn.Module, args: Any, output: Any) -> None:
    if torch.compiler.is_compiling():
        _traced.pop()
        registry.reset_backend(None)
        return
    stack = module.__dict__.get("_mindspeed_tokens")
    if stack:
        tokens = stack.pop()
        if len(tokens) == 3:
            registry.reset_backend(tokens[2])
            _running.reset(tokens[1])
        if tokens:
            registry.stop_counting(tokens[0])


_leave._mindspeed_scope = True


def _scoped_modules(hf_model: nn.Module, layers: tuple[nn.Module, ...] = ()) -> tuple[list[nn.Module],
                                                                                      list[nn.Module]]:
    """(the modules that carry the scope hooks, the decoder layers that enter the scope themselves).

    Hooked: the model, its backbone (TRL calls it directly), nested loss heads (called on their own: Qwen3-Omni's code
    predictor), and every decoder layer that does not enter the scope itself with its direct children: activation
    checkpointing reruns a layer's forward body in backward (transformers 5 checkpoints `forward`, outside the
    layer's own hooks), and the children's hooks run again there. A layer whose class runs one of our layer-scoped
    forwards (`switch(..., layer_forward=True)`, or HF's own wrapped by `_self_scope` when the model is attached)
    enters its model's scope itself, first thing, also where it is rerun: it and its children carry no hooks (an
    instance forward, selective recompute's, keeps the hooks).
    `layers`: more layers to hook (a diffusers denoiser's transformer blocks)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    found = {id(hf_model): hf_model}
    for layer in layers:
        for child in (layer, *layer.children()):
            found.setdefault(id(child), child)
    base = getattr(hf_model, "base_model", None)
    if isinstance(base, nn.Module):
        found.setdefault(id(base), base)
    entering: list[nn.Module] = []
    for module in hf_model.modules():
        head = getattr(type(module).forward, "_mindspeed_op", None) == "fused_linear_cross_entropy"
        if head and module is not hf_model:
            found.setdefault(id(module), module)
        if isinstance(module, GradientCheckpointingLayer):
            if _enters_scope(module):
                entering.append(module)
                continue
            for child in (module, *module.children()):
                found.setdefault(id(child), child)
    return list(found.values()), entering


def _enters_scope(layer: nn.Module) -> bool:
    """The layer runs its class's layer-scoped switch (no instance forward, no other library's class forward)."""
    return "forward" not in vars(layer) and getattr(compat.layer_function(type(layer)), "_mindspeed_enters_scope",
                                                    False)


def attach(hf_model: nn.Module, config: MindSpeedConfig, layers: tuple[nn.Module, ...] = ()) -> None:
    """Give `hf_model` its own config: current while it (or one of its layers, or one of `layers`) runs. Calling it
    again replaces the config; `detach` removes it."""
    detach(hf_model)
    if config.backend != "auto":
        registry.validate_backend_name(config.backend, "backend")
    counts = ran(hf_model)
    from transformers.modeling_layers import GradientCheckpointingLayer

    for module in hf_model.modules():
        if isinstance(module, GradientCheckpointingLayer) and "forward" not in vars(module):
            _self_scope(type(module))
    running = choice.running_config(config, _choices(hf_model))
    hooked, entering = _scoped_modules(hf_model, layers)
    for module in hooked:
        module.register_forward_pre_hook(_enter(running, counts))
        module.register_forward_hook(_leave, always_call=True)
    for layer in entering:
        layer.__dict__[_ENTER] = _enter(running, counts)  # a function: a deep copy of the model shares it
    hf_model._mindspeed_config, hf_model._mindspeed_running = config, running


def _choices(hf_model: nn.Module) -> frozenset[str]:
    """The ops HF's code may run on this model (patches/choice.py): none for a model without a transformers
    config (a diffusers denoiser)."""
    model_config = getattr(hf_model, "config", None)
    return choice.candidates(model_config) if hasattr(model_config, "model_type") else frozenset()


def running_config_of(model: nn.Module) -> MindSpeedConfig:
    """The config current while `model` runs: its own (or the process one) as its choices make it."""
    running = vars(model).get("_mindspeed_running")
    return running if running is not None else choice.running_config(config_of(model), _choices(model))


def ran(hf_model: nn.Module) -> dict[str, int]:
    """The model's counter of what ran: op -> executions of our kernels while it (or one of its layers) ran."""
    return hf_model.__dict__.setdefault("_mindspeed_ran", {})


def count_runs(hf_model: nn.Module) -> None:
    """For a model that follows the process config (built while enabled, given to no trainer): count what runs on
    it, without giving it a config of its own. A later attach() replaces this."""
    if any(getattr(h, "_mindspeed_scope", False) for h in hf_model._forward_pre_hooks.values()):
        return
    hf_model.register_forward_pre_hook(_enter(None, ran(hf_model), _choices(hf_model)))
    hf_model.register_forward_hook(_leave, always_call=True)


def detach(hf_model: nn.Module) -> None:
    """Remove what `attach` added (the model then follows the process config). Finds the hooks by their mark,
    so it also cleans a deep copy of an attached model."""
    for module in hf_model.modules():
        module.__dict__.pop(_ENTER, None)
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, fn in hooks.items() if getattr(fn, "_mindspeed_scope", False)]:
                del hooks[key]
                module._forward_hooks_always_called.pop(key, None)
    hf_model.__dict__.pop("_mindspeed_config", None)
    hf_model.__dict__.pop("_mindspeed_running", None)


def switch(op: str, fast: Callable, original: Callable, model_forward: bool = False,
           layer_forward: bool = False) -> Callable:
    """A function that runs `fast` when the current config has `op` on, else `original` (HF's own).

    It presents the original's name, signature and annotations (functools.wraps), so code that inspects a patched
    forward (Trainer's dataset columns and loss kwargs, transformers' output-field checks) sees HF's.
    `model_forward`: it replaces a top-level model's forward (the causal-LM heads), which may be called directly,
    past the model's hooks (PEFT 0.17-0.18's tuner calls `model.forward(...)`): the model's config and counter then
    apply all the same. `layer_forward`: it replaces a decoder layer's forward, which enters its model's scope before
    choosing, wherever it runs: in the model's forward (already current: one check) and where activation
    checkpointing reruns it in backward, outside every hook. The kernels' own sites (norms, MLPs, rope) pay for
    neither check."""

    def run(*args: Any, **kwargs: Any) -> Any:  # the hot path: one frame, kernel_on inlined
        return (fast if getattr(current().kernels, op) else original)(*args, **kwargs)

    if model_forward:
        @functools.wraps(original)
        def dispatch(*args: Any, **kwargs: Any) -> Any:
            owner = vars(args[0])
            if "_mindspeed_ran" in owner and not owner.get("_mindspeed_tokens"):
                with _inside(args[0], owner.get("_mindspeed_running")):
                    return run(*args, **kwargs)
            return run(*args, **kwargs)
    elif layer_forward:
        dispatch = functools.wraps(original)(_entering_scope(run))
    else:
        dispatch = functools.wraps(original)(run)
    dispatch._mindspeed_op = op
    return dispatch


def _entering_scope(run: Callable) -> Callable:
    """`run(self, ...)` for a decoder layer's forward, entering the scope of the layer's model first (the entry that
    `attach` left on the layer) where that scope is not current: in backward, where activation checkpointing reruns
    the forward outside every hook."""

    def dispatch(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        enter = self.__dict__.get(_ENTER)
        if enter is None or torch.compiler.is_compiling() or _inside_scope(enter):
            return run(self, *args, **kwargs)
        enter(self, ())
        try:
            return run(self, *args, **kwargs)
        finally:
            _leave(self, (), None)

    dispatch._mindspeed_enters_scope = True
    return dispatch


def _self_scope(layer_cls: type) -> None:
    """Make `layer_cls`'s forward (the function transformers' checkpointing wrapper calls, where there is one) enter
    its model's scope itself, HF's forward unchanged inside: its layers' parts then need no scope hooks, whose hooked
    module calls cost more host time than the one check per layer call. Recorded in the process's patches (disable()
    restores it); a forward already ours, or patched by us for another reason, stays."""
    owner, name = compat.layer_forward_slot(layer_cls)
    function = getattr(owner, name)
    if getattr(function, "_mindspeed_enters_scope", False) or PATCHES.is_patched(owner, name):
        return
    PATCHES.set(owner, name, functools.wraps(function)(_entering_scope(function)))


@contextlib.contextmanager
def _inside(model: nn.Module, config: MindSpeedConfig | None) -> Iterator[None]:
    """What the model's own hooks do around its forward, for a forward that was called past them. While Dynamo
    traces, the model's counter is not even read: the graph would be guarded on its values, and every eager forward
    in between (generate's prefill) would make the next compiled call recompile."""
    ops = _choices(model) if config is None else frozenset()
    if torch.compiler.is_compiling():
        _enter_traced(config if config is not None else _outermost(ops, compiling=True))
    else:
        _enter(config, ran(model), ops)(model, ())
    try:
        yield
    finally:
        _leave(model, (), None)
