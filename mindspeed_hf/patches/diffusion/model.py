"""diffusers denoisers under the accelerator: patching a family when diffusers imports its module, settling each
model (counted, its config current while it or one of its blocks runs, and the sites switched on for it), what
report() says of it, and putting everything back.

Nothing here imports diffusers: a family is patched when its modeling module is imported (now, or whenever the
user's script imports it), so `import mindspeed_hf` costs nothing in a script without diffusers.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ...device import model_device
from ...ops import registry
from .. import scope, third_party
from ..announce import announce as log_line
from ..engine import PATCHES
from . import sites, wan
from .families import DENOISERS, DenoiserFamily, denoiser_family

logger = logging.getLogger("mindspeed_hf")

OPS = ("rms_norm", "rope", "swiglu", "attention")
#: report()'s op -> the registry op that runs it
REGISTRY_OPS = {"rms_norm": "dit_rms_norm", "rope": "dit_rope", "swiglu": "swiglu_packed",
                "attention": "dit_attention"}
MODELING = "diffusers.models.modeling_utils"
_models: weakref.WeakSet = weakref.WeakSet()  # settled denoisers: disable() takes their hooks off
_state: dict[str, Any] = {"rope": set(), "warned": set()}  # families whose rope sites are ours; warned classes


# ----------------------------------------------------------------------------------------------------- lookups
def find_denoiser(model: nn.Module) -> nn.Module | None:
    """The diffusers ModelMixin inside `model` (itself, or under DDP / FSDP / accelerate wrappers); None when
    diffusers is not imported or there is none."""
    modeling = sys.modules.get(MODELING)
    if modeling is None or not isinstance(model, nn.Module):
        return None
    if isinstance(model, modeling.ModelMixin):
        return model
    return next((m for m in model.modules() if isinstance(m, modeling.ModelMixin)), None)


def family_of(model: nn.Module | None) -> DenoiserFamily | None:
    """The table entry of a denoiser (by its class or a base class), None when it has none."""
    if model is None:
        return None
    return denoiser_family(tuple(c.__name__ for c in type(model).__mro__))


def denoiser_blocks(model: nn.Module) -> list[nn.Module]:
    """A denoiser's transformer blocks in order: its family's block classes, else the classes its
    `_repeated_blocks` names (diffusers' own list of the blocks it repeats)."""
    family = family_of(model)
    names = set(family.blocks if family is not None else getattr(model, "_repeated_blocks", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def block_parts(block: nn.Module) -> dict[str, list[nn.Module]] | None:
    """A diffusers transformer block's direct children by selective-recompute part: "attention" (its attention
    modules), "mlp" (its feed-forward modules), "norms" (its norm and adaptive-norm modules); None when `block` has
    no diffusers attention child (not a diffusers block)."""
    processor_module = sys.modules.get("diffusers.models.attention_processor")
    attention_module = sys.modules.get("diffusers.models.attention")
    if processor_module is None or attention_module is None:
        return None
    kinds = (processor_module.Attention, attention_module.AttentionModuleMixin)
    children = list(block.children())
    attention = [c for c in children if isinstance(c, kinds)]
    if not attention:
        return None
    return {"attention": attention, "mlp": [c for c in children if "FeedForward" in type(c).__name__],
            "norms": [c for c in children if "Norm" in type(c).__name__]}


# ----------------------------------------------------------------------------------------------------- patching
def watch() -> None:
    """enable(): patch each family when diffusers imports its modeling module (now if it already has)."""
    for family in DENOISERS.values():
        third_party.when_imported(family.module, functools.partial(_patch_or_warn, family))


def _patch_or_warn(family: DenoiserFamily, module: ModuleType) -> None:
    """Patch a family right after its module's import; a failure costs the kernels, never the user's import."""
    try:
        patch_family(family, module)
    except Exception as err:  # noqa: BLE001  (inside someone else's import statement)
        logger.warning("mindspeed_hf: could not patch diffusers' %s (%s: %s); it runs unaccelerated", family.name,
                       type(err).__name__, err)


def _set(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    if hasattr(owner, name) and not PATCHES.is_patched(owner, name):
        PATCHES.set(owner, name, make(getattr(owner, name)))


def _patch_shared() -> None:
    """The sites every family shares: torch.nn.RMSNorm, diffusers' RMSNorm, attention_processor.py's F."""
    normalization = importlib.import_module("diffusers.models.normalization")
    _set(nn.RMSNorm, "forward", sites.rms_norm_forward)
    _set(normalization.RMSNorm, "forward", sites.rms_norm_forward)
    _set(importlib.import_module("diffusers.models.attention_processor"), "F", lambda _: sites.RoutedFunctional())


def patch_family(family: DenoiserFamily, module: ModuleType) -> None:
    """Patch the sites of `family` in its modeling module (idempotent; disable() restores them)."""
    _patch_shared()
    if family.dispatch_processors:
        _set(module, "dispatch_attention_fn", sites.dispatch_function)
    if family.rope:
        _set(module, family.rope, sites.qwen_rope_function if family.rope.endswith("_qwen") else sites.rope_function)
        _state["rope"].add(family.name)
    embeddings = importlib.import_module("diffusers.models.embeddings")
    for cls in _classes(module, family.local_rope):
        ours = sites.rope_function(embeddings.apply_rotary_emb)
        _set(cls, "__call__", lambda call, fast=ours: sites.local_rope_call(call, embeddings, fast))
        _state["rope"].add(family.name)
    for cls in _classes(module, family.rope_processor_calls):
        ours = wan.processor_call(module, cls.__call__)
        if ours is not None:
            _set(cls, "__call__", lambda call, fast=ours: sites.switch("rope", fast, call))
            _state["rope"].add(family.name)
    for cls in _classes(module, family.swiglu):
        _set(cls, "forward", sites.swiglu_forward)
    for cls in _classes(module, family.models):
        _set(cls, "__init__", _settle_on_init)


def _classes(module: ModuleType, names: tuple[str, ...]) -> list[type]:
    return [getattr(module, name) for name in names if hasattr(module, name)]


def _settle_on_init(original: Callable) -> Callable:
    """A family model class's __init__: the model, once built while enabled, is settled (counted, announced)."""

    @functools.wraps(original)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if scope.process_config() is not None and family_of(self) is not None:
            settle(self, None)
            announce(self)

    return __init__


# ------------------------------------------------------------------------------------------------------ models
def _enter(family: DenoiserFamily) -> Callable:
    def hook(module: nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():
            module.__dict__.setdefault("_mindspeed_denoiser_tokens", []).append(sites.enter(family))

    hook._mindspeed_scope = True  # scope.detach() takes it off with the config hooks
    return hook


def _leave(module: nn.Module, args: Any, output: Any) -> None:
    stack = module.__dict__.get("_mindspeed_denoiser_tokens")
    if stack and not torch.compiler.is_compiling():
        sites.leave(stack.pop())


_leave._mindspeed_scope = True


def settle(model: nn.Module, config: Any = None) -> None:
    """Accelerate a denoiser of a known family: `config` (None: the process one) current while it or one of its
    blocks runs, what runs counted, and the kernel sites switched on while it (or a block recomputed in backward)
    runs. Settling again replaces what an earlier call did."""
    family = family_of(model)
    blocks = denoiser_blocks(model)
    if config is not None:
        scope.attach(model, config, layers=tuple(blocks))  # takes earlier hooks off first
    else:
        scope.detach(model)
        scope.count_runs(model)
    for module in (model, *blocks):
        module.register_forward_pre_hook(_enter(family))
        module.register_forward_hook(_leave, always_call=True)
    _models.add(model)


def apply_to_model(model: nn.Module, config: Any) -> dict[str, Any]:
    """mindspeed_hf.apply_to_model for a diffusers model: settle it with `config`, log one line, return report().
    An unsupported denoiser runs unaccelerated with one warning per class."""
    denoiser = find_denoiser(model)
    family = family_of(denoiser)
    if family is None:
        name = type(denoiser).__name__
        if name not in _state["warned"]:
            _state["warned"].add(name)
            logger.warning("mindspeed_hf: diffusers model %s is not supported; it runs unaccelerated (supported: %s)",
                           name, ", ".join(f for family in DENOISERS.values() for f in family.models))
        return report(model)
    module = sys.modules.get(family.module)
    if module is not None:
        patch_family(family, module)  # idempotent: a module imported before enable() without a watch
    settle(denoiser, config)
    announce(denoiser)
    return report(model)


def release() -> None:
    """disable(): every settled denoiser's hooks and counters off (the patched symbols are restored with the rest)."""
    for model in list(_models):
        scope.detach(model)
        model.__dict__.pop("_mindspeed_ran", None)
    _models.clear()
    _state["rope"].clear()


# ------------------------------------------------------------------------------------------------------ report
def report(model: nn.Module) -> dict[str, Any]:
    """report() of a diffusers model: patched sites per op on this model, each op's implementation on its device,
    and what ran (executions of our kernels while it ran)."""
    denoiser = find_denoiser(model)
    family = family_of(denoiser)
    device = model_device(model)
    config = scope.config_of(denoiser)
    counts, kept = dict.fromkeys(OPS, 0), {}
    if family is not None and denoiser in _models and scope.process_config() is not None:
        counts, kept = _sites(denoiser, family, {op: bool(getattr(config.kernels, op)) for op in OPS})
    ran, fallbacks = registry.split_fallbacks(scope.ran(denoiser)) if denoiser in _models else ({}, {})
    token = registry.use_backend(None if config.backend == "auto" else config.backend)
    try:
        return {
            "model_type": family.name if family is not None else type(denoiser).__name__,
            "backend": registry.resolve_backend(device),
            "kernels": counts,
            "implementations": {op: registry.implementation(name, device) for op, name in REGISTRY_OPS.items()},
            "add_rms_norm_layers": 0,
            "attention_implementation": "mindspeed" if counts["attention"] else "diffusers",
            "skip_logits": None,
            "kept": kept,
            "ran": {**dict.fromkeys(OPS, 0), **{op: n for op, n in ran.items() if op in OPS}},
            # calls a device kernel handed to the torch path (the warning names why): not counted in "ran"
            "fallbacks": fallbacks,
        }
    finally:
        registry.reset_backend(token)


def _sites(denoiser: nn.Module, family: DenoiserFamily, on: dict[str, bool]) -> tuple[dict[str, int], dict]:
    """(patched sites per op, ops kept as the user chose them) of a settled denoiser."""
    counts, kept = dict.fromkeys(OPS, 0), {}
    native = sites.native_default()
    if not native:
        active = sys.modules[sites.DISPATCH]._AttentionBackendRegistry._active_backend
        kept["attention"] = f"{getattr(active, 'value', active)} (chosen for the process)"
    norms = tuple(c for c in (nn.RMSNorm, getattr(sys.modules.get("diffusers.models.normalization"), "RMSNorm", None))
                  if c is not None)
    for sub in denoiser.modules():
        name = type(sub).__name__
        if isinstance(sub, norms) and getattr(sub, "weight", None) is not None:
            counts["rms_norm"] += on["rms_norm"]
        elif name in family.swiglu:
            counts["swiglu"] += on["swiglu"]
        elif name in family.attention:
            processor = getattr(sub, "processor", None)
            kind = type(processor).__name__
            explicit = getattr(processor, "_attention_backend", None)
            if kind in family.dispatch_processors and explicit is not None:
                kept["attention"] = f"{getattr(explicit, 'value', explicit)} (requested explicitly)"
            elif kind in family.dispatch_processors or kind in family.sdpa_processors:
                counts["attention"] += on["attention"] and native
            rope = kind in family.rope_processors and not getattr(sub, "is_cross_attention", False)
            counts["rope"] += rope and on["rope"] and family.name in _state["rope"]
    return counts, kept


def announce(model: nn.Module) -> None:
    log_line(model, report(model))
