"""Selective recompute: chosen parts of a decoder layer run under torch.utils.checkpoint (non-reentrant).

A part (`self_attn`, `mlp`, a norm: a direct child of the decoder layer) gets an instance `forward` that runs its
own forward under `checkpoint` while the model trains with gradients, and plainly otherwise. Nothing of the layer's
code is copied: the class's forward (with whatever kernel is patched into it) is what runs, once in forward and
once more in backward. The recomputation is that forward alone, on the inputs the forward got: the part's module
hooks do not run again (a tensor-parallel plan's input hooks would redistribute inputs already redistributed); it
runs in the context captured at the forward, so the config, backend and kernel counter that
mindspeed_hf.patches.scope's hooks made current are current again, on any thread. `unwrap` removes the instance
forward, and the module is exactly what it was.

`attention_core` checkpoints the whole self-attention too, with a per-op policy (torch's selective activation
checkpoint contexts): the outputs of the 2-D matmuls (the q/k/v/o projections, LoRA's included) are kept, and
everything between them (q/k norms, rotary embedding, the attention kernel) is recomputed.
"""

from __future__ import annotations

import contextvars
import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_STATE = "_mindspeed_recompute"  # instance attribute: (forward set on the instance before ours, context_fn)
# True while a recomputation reruns a part in backward: a wrapped part nested inside it (selective self_attn around
# the attention core, say) then runs its forward directly, not under a checkpoint of its own inside the replay.
_replaying: contextvars.ContextVar[bool] = contextvars.ContextVar("mindspeed_hf_recompute_replay", default=False)
# KV-cache keyword names across families and releases: a recomputed attention must not update a cache twice.
_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")
_KEPT_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})


def _keep_projections(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """attention_core's policy: keep the projection matmuls' outputs, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in _KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


ATTENTION_CORE_CONTEXT: Callable = functools.partial(create_selective_checkpoint_contexts, _keep_projections)


def is_wrapped(module: nn.Module) -> bool:
    """True when `wrap` made this module recompute."""
    return _STATE in module.__dict__


def wrap(module: nn.Module, context_fn: Callable | None = None) -> None:
    """Make `module`'s forward run under non-reentrant checkpoint while training with gradients.

    `context_fn` is checkpoint's (e.g. ATTENTION_CORE_CONTEXT for a per-op policy); None recomputes everything.
    Wrapping again replaces the previous wrap."""
    unwrap(module)
    module.__dict__[_STATE] = (module.__dict__.get("forward"), context_fn)
    module.forward = types.MethodType(_recomputed_forward, module)


def unwrap(module: nn.Module) -> None:
    """Undo `wrap` (no-op on a module that is not wrapped): the forward is the one it had before."""
    state = module.__dict__.pop(_STATE, None)
    if state is None:
        return
    previous, _ = state
    if previous is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = previous


def _inner(module: nn.Module) -> Callable:
    previous, _ = module.__dict__[_STATE]
    return previous if previous is not None else types.MethodType(type(module).forward, module)


def _recomputed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    inner = _inner(self)
    if _replaying.get() or not (self.training and torch.is_grad_enabled()):
        return inner(*args, **kwargs)
    for name in _CACHE_KWARGS:  # the recomputation would append to the cache a second time
        if kwargs.get(name) is not None:
            kwargs[name] = None
    _, context_fn = self.__dict__[_STATE]
    context = contextvars.copy_context()  # what the hooks around this call made current
    first = [True]

    def run(*tensors: Any) -> Any:
        if first[0]:  # the forward
            first[0] = False
            return inner(*tensors, **kwargs)
        return context.run(_replay, inner, tensors, kwargs)  # the recomputation, in backward

    extra = {"context_fn": context_fn} if context_fn is not None else {}
    return checkpoint(run, *args, use_reentrant=False, **extra)


def _replay(inner: Callable, args: tuple, kwargs: dict[str, Any]) -> Any:
    token = _replaying.set(True)
    try:
        return inner(*args, **kwargs)
    finally:
        _replaying.reset(token)


_recomputed_forward._mindspeed_transparent = True  # it runs the class forward: report() looks through it
