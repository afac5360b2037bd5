"""The forwards that replace HF's module forwards. Each calls the model's own submodules and parameters, so
PEFT adapters, FSDP hooks and HF's casting rules keep working; only the math goes to a fused kernel. Every
function carries `_mindspeed_op` so report() can count what really runs.

Decoder layers: the residual add before a norm becomes one add+norm kernel (ops.rms_norm.add_rms_norm) where the
backend has one (npu). A layer forward is replaced only where HF's own forward is, statement for statement, one of
the shapes in LAYER_SHAPES (read from its source when the family is patched): anything else keeps HF's forward, so
the fused forward is always HF's code with the add and the norm fused. At run time HF's layer forward runs instead
on a backend without an add+norm kernel (torch, cuda: the same ops, less Python) and where the norm is not plainly
ours (a hook, an instance forward such as selective recompute's, another class, DTensor weights).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from transformers.activations import SiLUActivation

from ..ops.linear import project, stackable
from ..ops.registry import has_own_kernel
from ..ops.rms_norm import add_rms_norm, add_rms_norm_fuses, rms_norm
from ..ops.rotary import apply_rotary_pos_emb, apply_rotary_pos_emb_half_width, apply_rotary_pos_emb_interleaved
from ..ops.swiglu import swiglu, swiglu_packed
from ..releases import compat
from ..releases.seams import source_of

SILU = (nn.SiLU, SiLUActivation)


def tag(op: str, fn: Callable) -> Callable:
    """Mark `fn` as the replacement that runs `op` (read by report())."""
    fn._mindspeed_op = op
    return fn


def rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def offset_rms_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, self.weight, self.eps, offset=True)


def swiglu_mlp_forward(original: Callable) -> Callable:
    """gate/up/down MLP; a non-SiLU activation (set in the config) keeps the original forward."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.act_fn, SILU):
            return original(self, x)
        gate, up = project(x, (self.gate_proj, self.up_proj))
        return self.down_proj(swiglu(gate, up))

    return tag("swiglu", forward)


def packed_swiglu_mlp_forward(original: Callable) -> Callable:
    """Phi-3's gate_up_proj MLP: the packed projection feeds the kernel without a split."""

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.activation_fn, SILU):
            return original(self, hidden_states)
        return self.down_proj(swiglu_packed(self.gate_up_proj(hidden_states)))

    return tag("swiglu", forward)


QKV = ("q_proj", "k_proj", "v_proj")


def stacked_qkv_forward(original: Callable) -> Callable:
    """HF's attention forward with its q/k/v projections as one stacked matmul (ops/linear.py) where the backend
    stacks and they are plain nn.Linear layers: the three outputs are computed first and handed over when HF's
    forward calls each projection on that same input (any other input runs the layer itself)."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        x = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(x, torch.Tensor) or not has_own_kernel("stacked_linear", x.device):
            return original(self, *args, **kwargs)  # (the backend's answer first: the cheaper question)
        layers = tuple(getattr(self, name, None) for name in QKV)
        if not stackable(x, layers):
            return original(self, *args, **kwargs)
        with _served(layers, x, project(x, layers)):
            return original(self, *args, **kwargs)

    return tag("stacked_linear", forward)


@contextlib.contextmanager
def _served(layers: tuple[nn.Linear, ...], x: torch.Tensor, outputs: tuple[torch.Tensor, ...]) -> Iterator[None]:
    """Each layer, called on `x` inside the block, returns its output from `outputs` (an instance forward, removed
    on the way out)."""
    for layer, out in zip(layers, outputs):
        layer.forward = functools.partial(_serve, layer, x, out)
    try:
        yield
    finally:
        for layer in layers:
            vars(layer).pop("forward", None)


def _serve(layer: nn.Linear, x: torch.Tensor, out: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    return out if given is x else nn.functional.linear(given, layer.weight, layer.bias)


def _rope_forward(apply: Callable) -> Callable:
    """A modeling module's rope function in one of ROPE_LAYOUTS, with every signature the releases give it
    (see compat.rope_unsqueeze_dim)."""

    def rope_forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any,
                     **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return apply(q, k, cos, sin, compat.rope_unsqueeze_dim(args, kwargs))

    return tag("rope", rope_forward)


#: layout -> the replacement of a modeling module's rope function in that layout (ModelFamily.rope_layouts):
#: "half" HF's usual rotate_half rope, "half_width" GPT-OSS's (half-width tables), "interleaved" DeepSeek-V3's
#: apply_rotary_pos_emb_interleave (pairs turned, laid out evens then odds)
ROPE_LAYOUTS = {"half": _rope_forward(apply_rotary_pos_emb),
                "half_width": _rope_forward(apply_rotary_pos_emb_half_width),
                "interleaved": _rope_forward(apply_rotary_pos_emb_interleaved)}


tag("rms_norm", rms_norm_forward)
tag("rms_norm", offset_rms_norm_forward)


# HF decoder-layer bodies (from `residual = hidden_states`, comments and blank lines left out, the self_attn call
# shown as `(...)`) that the fused layer forwards reproduce. "pre": Llama-shaped pre-norm layers, the add after
# the attention fused into post_attention_layernorm. "sandwich": Gemma2/3's, the add after the post-attention norm
# fused into pre_feedforward_layernorm.
LAYER_SHAPES: dict[str, tuple[str, ...]] = {
    "pre": ("residual = hidden_states", "hidden_states = self.input_layernorm(hidden_states)",
            "hidden_states, _ = self.self_attn(...)", "hidden_states = residual + hidden_states",
            "residual = hidden_states", "hidden_states = self.post_attention_layernorm(hidden_states)",
            "hidden_states = self.mlp(hidden_states)", "hidden_states = residual + hidden_states",
            "return hidden_states"),
    "sandwich": ("residual = hidden_states", "hidden_states = self.input_layernorm(hidden_states)",
                 "hidden_states, _ = self.self_attn(...)",
                 "hidden_states = self.post_attention_layernorm(hidden_states)",
                 "hidden_states = residual + hidden_states", "residual = hidden_states",
                 "hidden_states = self.pre_feedforward_layernorm(hidden_states)",
                 "hidden_states = self.mlp(hidden_states)",
                 "hidden_states = self.post_feedforward_layernorm(hidden_states)",
                 "hidden_states = residual + hidden_states", "return hidden_states"),
}
_ATTN_CALL = re.compile(r"hidden_states, _ = self\.self_attn\((.*?)\)\n", re.S)
_PASSED = re.compile(r"^(\w+)=\1$")


def layer_shape(forward: Callable) -> tuple[str, tuple[str, ...]] | None:
    """(shape name, the names HF's forward passes on to self_attn as `name=name`) when `forward`'s body is one of
    LAYER_SHAPES and its self_attn call passes only its own arguments (plus **kwargs); None otherwise (source not
    readable, another body, a decorator we do not know)."""
    inner = inspect.unwrap(forward)
    if any(_renamed(f) is None for f in _wrappers(forward)):
        return None
    try:
        source = source_of(inner)
    except (OSError, TypeError):
        return None
    start = source.find("residual = hidden_states")
    call = _ATTN_CALL.search(source, start)
    if start < 0 or call is None:
        return None
    args = [a.strip() for a in call.group(1).split(",") if a.strip()]
    names = [m.group(1) for m in map(_PASSED.match, args) if m]
    params = inspect.signature(inner).parameters
    if names[:1] != ["hidden_states"] or len(names) != len(args) - (args[-1:] == ["**kwargs"]) \
            or not set(names) <= set(params) or (args[-1:] == ["**kwargs"]) != ("kwargs" in params):
        return None
    body = source[start:call.start()] + "hidden_states, _ = self.self_attn(...)\n" + source[call.end():]
    lines = tuple(line.split("#")[0].strip() for line in body.splitlines())
    lines = tuple(line for line in lines if line)
    shape = next((name for name, want in LAYER_SHAPES.items() if lines == want), None)
    return None if shape is None else (shape, tuple(names[1:]))


def _wrappers(fn: Callable) -> list[Callable]:
    out = []
    while hasattr(fn, "__wrapped__"):
        out.append(fn)
        fn = fn.__wrapped__
    return out


def _renamed(wrapper: Callable) -> str | None:
    """The deprecated keyword a transformers `deprecate_kwarg` wrapper renames (None: not such a wrapper)."""
    code, cells = getattr(wrapper, "__code__", None), getattr(wrapper, "__closure__", None) or ()
    free = dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code is not None else {}
    return free.get("old_name") if isinstance(free.get("old_name"), str) else None


def _ours(hooks: dict) -> bool:
    return not hooks or all(getattr(hook, "_mindspeed_scope", False) for hook in hooks.values())


def _plain_norm(norm: nn.Module, classes: tuple[type, ...]) -> bool:
    """The norm runs nothing but its class forward (ours) inside our own scope hooks: no other hook, no instance
    forward, no other library's class forward (LLaMA-Factory's liger patch: its kernel keeps running, and report()
    names it), plain tensor weights."""
    return (type(norm) in classes and "forward" not in vars(norm)
            and getattr(type(norm).forward, "_mindspeed_op", None) == "rms_norm" and _ours(norm._forward_hooks)
            and _ours(norm._forward_pre_hooks) and type(norm.weight) in (torch.Tensor, nn.Parameter)
            and not compat.global_module_hooks())


@contextlib.contextmanager
def _norm_scope(norm: nn.Module, x: torch.Tensor) -> Iterator[None]:
    """What the norm's own (scope) hooks do around its forward: its model's config current, its kernels counted
    (also where activation checkpointing reruns the layer body in backward, outside the layer's hooks)."""
    for hook in list(norm._forward_pre_hooks.values()):
        hook(norm, (x,))
    try:
        yield
    finally:
        for hook in list(norm._forward_hooks.values()):
            hook(norm, (x,), None)


def _norm_eps(norm: nn.Module) -> float:
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


def _binder(signature: inspect.Signature) -> Callable:
    """`bind(self, args, kwargs)` -> (named arguments with defaults, the extra keyword arguments): what
    `signature.bind` + `apply_defaults` give for a forward `(self, a, b=..., ..., **kwargs)`, worked out once here
    instead of per call. Anything else (positional varargs, keyword-only, a clash) goes through `signature.bind`,
    which also raises Python's own errors."""
    params = list(signature.parameters.values())
    kinds = {p.kind for p in params}
    plain = kinds <= {inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.VAR_KEYWORD}
    var_kw = next((p.name for p in params if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    required = {p.name for p in params if p.default is inspect.Parameter.empty and p.name != var_kw}

    def slow(self, args, kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        named = dict(bound.arguments)
        return named, named.get(var_kw, {}) if var_kw else {}

    def bind(self, args, kwargs):
        if not plain or len(args) + 1 > len(positional):
            return slow(self, args, kwargs)
        named = dict(defaults)
        named.update(zip(positional, (self, *args)))
        extra = {}
        for key, value in kwargs.items():
            if key in named and key in positional[:len(args) + 1]:
                return slow(self, args, kwargs)  # given twice: Python's error
            if key in defaults or key in required:
                named[key] = value
            elif var_kw is not None:
                extra[key] = value
            else:
                return slow(self, args, kwargs)  # unexpected keyword: Python's error
        if not required <= named.keys():
            return slow(self, args, kwargs)  # one missing: Python's error
        return named, extra

    return bind


def fused_layer_forward(original: Callable, shape: str, attn_args: tuple[str, ...], norm_classes: tuple[type, ...],
                        offset: bool) -> Callable:
    """A decoder-layer forward equal to `original` (whose body is LAYER_SHAPES[shape]) with the residual add and
    the norm after it in one add_rms_norm call. `attn_args`: what HF passes on to self_attn, by name."""
    signature = inspect.signature(inspect.unwrap(original))
    renamed = {_renamed(f) for f in _wrappers(original)}
    fused_norm = "post_attention_layernorm" if shape == "pre" else "pre_feedforward_layernorm"
    bind = _binder(signature)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        norm = getattr(self, fused_norm)
        if (renamed and not renamed.isdisjoint(kwargs)) or not add_rms_norm_fuses(norm.weight.device) \
                or not _plain_norm(norm, norm_classes):
            return original(self, *args, **kwargs)
        named, extra = bind(self, args, kwargs)
        hidden_states = named["hidden_states"]
        passed = {name: named[name] for name in attn_args}
        passed.update(extra)
        residual = hidden_states
        hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **passed)
        if shape == "sandwich":
            hidden_states = self.post_attention_layernorm(hidden_states)
        # the layer entered the scope: the norm carries no hooks of its own unless the layer runs past its class forward
        hooked = norm._forward_pre_hooks or norm._forward_hooks
        with _norm_scope(norm, hidden_states) if hooked else contextlib.nullcontext():
            hidden_states, residual = add_rms_norm(residual, hidden_states, norm.weight, _norm_eps(norm), offset)
        hidden_states = self.mlp(hidden_states)
        if shape == "sandwich":
            hidden_states = self.post_feedforward_layernorm(hidden_states)
        return residual + hidden_states

    return tag("add_rms_norm", forward)


def fused_layer(forward: Callable, norm_classes: tuple[type, ...], offset: bool) -> Callable | None:
    """The fused version of decoder-layer forward `forward` (whose norms are `norm_classes`), or None where it is
    not one of LAYER_SHAPES."""
    shape = layer_shape(forward) if norm_classes else None
    return None if shape is None else fused_layer_forward(forward, *shape, norm_classes, offset)
