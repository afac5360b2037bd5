"""Logits made on first read: what a forward with labels returns in `outputs.logits` when the fused loss computed the
loss from the hidden states (kernels.skip_logits: auto, outside Trainer's own loss computation).

`DeferredLogits` is a tensor with HF's logits' shape, dtype, device and requires_grad but no storage. Reading its
metadata (`.shape`, `.dtype`, `.device`, `.size()`, `.dim()`) builds nothing; any other use - an operator, a method,
indexing, `repr`, a dtype cast - computes HF's logits once, from the kept final hidden states through the model's
real lm_head (Gemma's softcap applied as HF does), under the grad mode and autocast state of the forward that made
it, and runs the operation on them; a loss built on them backpropagates into the model exactly as HF's would. Read
again, the same tensor is used. A cast (`.float()`, `.to(dtype)`, what accelerate's mixed-precision output conversion
does to every output) returns another deferred tensor, so that conversion builds nothing either. The top-1 token per
position (`logits.argmax(-1)`, `torch.argmax(logits, dim=-1)`: a token-accuracy metric such as ms-swift's) is read
chunk by chunk through the lm_head, one [chunk, vocab] block at a time, without building the logits.

Deferred only where the lm_head can be called again after the forward as it was inside it: its parameters are plain
local tensors (not tensor-parallel DTensors, not DeepSpeed ZeRO-3 partitions) and torch.compile is not tracing;
elsewhere the forward builds the logits as HF does. Under DDP and FSDP2 (whose root and our lm_head group stay
unsharded from the forward until their backward) the head is called then as in one process. A read after the
lm_head's parameters changed - an optimizer step updated them, FSDP resharded them after the backward - cannot give
that forward's logits any more: it raises an error naming the two ways out (read before, or skip_logits: never)
instead of returning other numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ..ops.fused_linear_cross_entropy import default_chunk_size

__all__ = ["DeferredLogits", "can_defer", "deferred_logits"]

_METADATA = {torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
             torch.Tensor.ndim.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.layout.__get__,
             torch.Tensor.is_cuda.__get__, torch.Tensor._base.__get__, torch.Tensor.size, torch.Tensor.dim,
             torch.Tensor.numel, torch.Tensor.is_floating_point, torch.Tensor.__len__}
_CASTS = {torch.Tensor.float: torch.float32, torch.Tensor.half: torch.float16, torch.Tensor.bfloat16: torch.bfloat16,
          torch.Tensor.double: torch.float64}


class DeferredLogits(torch.Tensor):
    """HF's logits, computed on first use (see the module docstring)."""

    @staticmethod
    def __new__(cls, make: Callable[[], torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device, requires_grad: bool,
                top1: Callable[[], torch.Tensor] | None = None) -> DeferredLogits:
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)
        self._make, self._value, self._hooks, self._top1 = make, None, [], top1
        return self

    def materialize(self) -> torch.Tensor:
        """HF's logits (computed now if they were not yet)."""
        if self._value is None:
            self._value, self._make = self._make(), None
            for hook in self._hooks:
                hook.attach(self._value)
        return self._value

    def _register_hook(self, hook: Callable) -> _PendingHook:
        """`register_hook` before the logits exist (FSDP2 and DDP hook every output of a forward): kept and attached
        when they are made, since a gradient can only reach the logits through the made tensor."""
        pending = _PendingHook(hook, self._hooks)
        self._hooks.append(pending)
        return pending

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return repr(self.materialize())

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, cls) and first._value is None:
            if func in _METADATA:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            if func is torch.Tensor.register_hook:
                return first._register_hook(*args[1:], **kwargs)
            if first._top1 is not None and _is_vocab_argmax(func, args, kwargs, first.dim()):
                return first._top1()
            dtype = _cast_dtype(func, args, kwargs)
            if dtype is not None:
                return first if dtype == first.dtype else _cast(first, dtype)
        args, kwargs = tree_map(_real, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # reached only by code that bypasses __torch_function__: the operation runs on the computed logits
        args, kwargs = tree_map(_real, (args, kwargs or {}))
        return func(*args, **kwargs)


class _PendingHook:
    """The handle `register_hook` returns for logits not made yet: attached to them when they are made."""

    def __init__(self, hook: Callable, pending: list) -> None:
        self._hook, self._pending, self._handle = hook, pending, None

    def attach(self, tensor: torch.Tensor) -> None:
        self._handle = tensor.register_hook(self._hook) if tensor.requires_grad else None

    def remove(self) -> None:
        if self in self._pending:
            self._pending.remove(self)
        if self._handle is not None:
            self._handle.remove()


def _real(value: Any) -> Any:
    return value.materialize() if isinstance(value, DeferredLogits) else value


def _cast_dtype(func: Callable, args: tuple, kwargs: dict) -> torch.dtype | None:
    """The dtype of a pure dtype cast (`.float()`, `.to(torch.float32)`), else None."""
    if func in _CASTS and len(args) == 1 and not kwargs:
        return _CASTS[func]
    if func is torch.Tensor.to and len(args) == 2 and isinstance(args[1], torch.dtype) and not kwargs:
        return args[1]
    return None


def _cast(source: DeferredLogits, dtype: torch.dtype) -> DeferredLogits:
    # a widening cast (bf16 -> fp32, what accelerate's output conversion does) keeps every argmax: top-1 carries over
    widening = torch.finfo(dtype).bits > torch.finfo(source.dtype).bits if dtype.is_floating_point else False
    return DeferredLogits(lambda: source.materialize().to(dtype), source.shape, dtype, source.device,
                          source.requires_grad, source._top1 if widening else None)


_ARGMAX = (torch.Tensor.argmax, torch.argmax)


def _is_vocab_argmax(func: Callable, args: tuple, kwargs: dict, ndim: int) -> bool:
    """`logits.argmax(-1)` / `torch.argmax(logits, dim=-1)`: the top-1 token per position (a token-accuracy metric,
    ms-swift's), which the chunked pass gives without the [tokens, vocab] logits."""
    if func not in _ARGMAX or len(args) > 3 or set(kwargs) - {"dim", "keepdim"}:
        return False
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    return isinstance(dim, int) and dim in (-1, ndim - 1) and not keepdim


def can_defer(lm_head: torch.nn.Module) -> bool:
    """True where the lm_head can be called again after the forward, as it was inside it (module docstring)."""
    if torch.compiler.is_compiling():
        return False
    params = list(lm_head.parameters())
    return bool(params) and all(type(p) in (torch.Tensor, torch.nn.Parameter) and not hasattr(p, "ds_id")
                                for p in params) and \
        not any(_is_fsdp(m) for m in lm_head.modules() if m is not lm_head)  # a sharded part: hooks of its own


def _is_fsdp(module: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return isinstance(module, FSDPModule)


def _head(lm_head: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """How to call the lm_head again: as a module, or, where it is an FSDP2 group of its own (unsharded from its
    forward until its post-backward), through its forward without FSDP's hooks, which already ran for this
    forward and would register its gradient reduction a second time."""
    return lm_head.forward if _is_fsdp(lm_head) else lm_head


def _state(lm_head: torch.nn.Module) -> list[tuple[int, int, int, int] | None]:
    """What identifies the lm_head's parameter values: each parameter object, its in-place version and its storage
    (None for a parameter that is no plain tensor any more: FSDP put its sharded DTensor back)."""
    return [(id(p), p._version, p.untyped_storage().data_ptr(), p.untyped_storage().nbytes())
            if type(p) in (torch.Tensor, torch.nn.Parameter) else None for p in lm_head.parameters()]


def _stale_error() -> RuntimeError:
    return RuntimeError(
        "mindspeed_hf: outputs.logits was first read after the lm_head's parameters changed (an optimizer step, or "
        "FSDP resharding them after the backward), so the logits of that forward cannot be made any more (the fused "
        "loss computed its loss without them); read outputs.logits before loss.backward() / optimizer.step(), or set "
        "kernels.skip_logits: never (MINDSPEED_HF_KERNELS_SKIP_LOGITS, --mindspeed_skip_logits) to have the forward "
        "build them as HF does")


def deferred_logits(lm_head: torch.nn.Module, hidden_states: torch.Tensor,
                    finish: Callable[[torch.Tensor], torch.Tensor] | None = None) -> DeferredLogits:
    """`finish(lm_head(hidden_states))` (finish: e.g. a softcap), made on first read under this forward's grad mode
    and autocast state."""
    grad = torch.is_grad_enabled()
    device = hidden_states.device.type
    autocast = torch.is_autocast_enabled(device) if device in ("cpu", "cuda", "npu") else False
    autocast_dtype = torch.get_autocast_dtype(device) if autocast else None

    state, head = _state(lm_head), _head(lm_head)

    def make() -> torch.Tensor:
        if _state(lm_head) != state:
            raise _stale_error()
        with torch.set_grad_enabled(grad), torch.autocast(device, dtype=autocast_dtype, enabled=autocast):
            logits = head(hidden_states)
            return finish(logits) if finish is not None else logits

    def top1() -> torch.Tensor:
        """The argmax over the vocabulary of every position, chunk by chunk (one [chunk, vocab] block at a time, no
        gradient): what `make().argmax(-1)` gives, without the logits."""
        if _state(lm_head) != state:
            raise _stale_error()
        flat = hidden_states.detach().reshape(-1, hidden_states.shape[-1])
        rows = default_chunk_size(width)
        out = torch.empty(flat.shape[0], dtype=torch.long, device=on)
        with torch.no_grad(), torch.autocast(device, dtype=autocast_dtype, enabled=autocast):
            for start in range(0, flat.shape[0], rows):
                logits = head(flat[start:start + rows])
                out[start:start + rows] = (finish(logits) if finish is not None else logits).argmax(-1)
        return out.reshape(hidden_states.shape[:-1])

    if type(lm_head) is torch.nn.Linear:  # what make() will return, known without running it
        width, dtype, on = lm_head.out_features, autocast_dtype or hidden_states.dtype, hidden_states.device
    else:  # a wrapped head (PEFT, quantized): run it on one position, its random state kept (dropout)
        with torch.no_grad(), torch.autocast(device, dtype=autocast_dtype, enabled=autocast), \
                torch.random.fork_rng(devices=[hidden_states.device] if device in ("cuda", "npu") else [],
                                      device_type=device if device in ("cuda", "npu") else "cuda"):
            probe = head(hidden_states.reshape(-1, hidden_states.shape[-1])[:1])
            probe = finish(probe) if finish is not None else probe
        width, dtype, on = probe.shape[-1], probe.dtype, probe.device
    return DeferredLogits(make, (*hidden_states.shape[:-1], width), dtype, on,
                          grad and (hidden_states.requires_grad or any(p.requires_grad for p in lm_head.parameters())),
                          top1)
