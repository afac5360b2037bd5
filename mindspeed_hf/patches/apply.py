"""Applying the family table: enable() patches classes and module functions (models built before and after),
apply_to_model() settles one existing model (PEFT-wrapped too), disable() restores every original; report() (what
really runs on a given model) is patches/reporting.py's."""

from __future__ import annotations

import functools
import logging
import os
import sys
import weakref
from typing import Any

from torch import nn

from ..config import MindSpeedConfig
from ..ops import registry
from ..ops.attention import ATTENTION_NAME, OUR_ATTENTIONS, register_attention, unregister_attention
from ..ops.experts import define_traced_op
from ..releases import compat
from . import diffusion, experts, linear_attention, scope, third_party
from .announce import announce as _announce
from .engine import FUSED_LAYERS, PATCHES
from .families import FAMILIES, ModelFamily
from .patching import set_once
from .reporting import family_of, find_hf_model, replacements, report  # noqa: F401  (the package's public API)
from .reporting import modeling as _modeling
from .sites import SITES

logger = logging.getLogger("mindspeed_hf")

_patches = PATCHES  # the process's patch record (engine.py): disable() restores it
# The process config itself lives in scope (the kernels read it there); here only whether it was given explicitly.
_state: dict[str, Any] = {"explicit": None, "warned_types": set(), "taken": set()}
# Models whose attention may point at our kernel: disable() switches them back to sdpa.
_models: weakref.WeakSet = weakref.WeakSet()
_fused_layers = FUSED_LAYERS  # decoder-layer classes whose residual add runs fused into their norm


def _replaceable(model: nn.Module, family: ModelFamily) -> bool:
    """Whether our attention can take the place of this model's sdpa with the same results."""
    return family.attention_interface or compat.sdpa_replaceable(model)


def _attention_default(original, family: ModelFamily):
    """Wrap XPreTrainedModel.get_correct_attn_implementation: the default (no request) becomes our kernel when the
    current config has attention on; an explicit request ("sdpa", "eager", ...) is kept and remembered."""

    @functools.wraps(original)
    def get_correct_attn_implementation(self, requested_attention=None, is_init_check=False):
        if requested_attention is None:
            if scope.kernel_on("attention") and self._supports_sdpa and _replaceable(self, family):
                requested_attention = ATTENTION_NAME
        else:
            requested_attention = _taken_flash(self, family, requested_attention)
            if requested_attention != ATTENTION_NAME:
                self._mindspeed_explicit_attention = requested_attention
        return original(self, requested_attention, is_init_check)

    return get_correct_attn_implementation


FLASH_NAMES = ("flash_attention_2", "flash_attention_3")


def _taken_flash(model: nn.Module, family: ModelFamily, requested: str) -> str:
    """`requested`, or our attention's name for a flash name under kernels.take_flash_attention (where ours can take
    the model's attention: the same rule as the default)."""
    config = scope.current().kernels
    if requested not in FLASH_NAMES or not (config.take_flash_attention and config.attention):
        return requested
    if not (model._supports_sdpa and _replaceable(model, family)):
        return requested
    if requested not in _state["taken"]:
        _state["taken"].add(requested)
        logger.info("mindspeed_hf: attn_implementation %r runs mindspeed_hf's attention (%s) "
                    "(kernels.take_flash_attention)", requested, ATTENTION_NAME)
    return ATTENTION_NAME


def _flash_checked(original, family: ModelFamily):
    """Wrap XPreTrainedModel._check_and_adjust_attn_implementation: a flash name taken by kernels.take_flash_attention
    is ours before transformers looks for the flash_attn package or a hub kernel."""

    @functools.wraps(original)
    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        if isinstance(attn_implementation, str):
            attn_implementation = _taken_flash(self, family, attn_implementation)
        return original(self, attn_implementation, *args, **kwargs)

    return _check_and_adjust_attn_implementation


def _announce_on_init(original):
    """Wrap XPreTrainedModel.post_init to log one line per top-level model built while enabled."""

    @functools.wraps(original)
    def post_init(self):
        original(self)
        _models.add(self)
        if getattr(self, "base_model", self) is not self:  # the top-level model, not its inner base model
            scope.count_runs(self)
            _announce(self, report(self))

    return post_init


def _patch_family(family: ModelFamily, default_attention: bool = True) -> None:
    """Run every kernel site of the table (sites.SITES) on the family, then wire its model classes: the attention
    default and the flash check, and one log line per model built. Each patched site asks the current config
    whether its op is on. A third-party family is patched when its module is imported (now, or whenever the user
    imports it); patched at its import, its models keep the attention they are built with until apply_to_model
    (qwen-tts passes its config's attn_implementation on as a request, which the attention default would keep as
    explicit)."""
    if family.modeling and _modeling(family) is None:
        third_party.when_imported(family.modeling, lambda _: _patch_family(family, default_attention=False))
        return
    if not family.modeling and family.modeling_module not in sys.modules:
        # not imported yet: patched right after its import (`import mindspeed_hf` imports no modeling module)
        third_party.when_imported(family.modeling_module, lambda _: _patch_family(family))
        return
    module = _modeling(family)
    if module is None:
        return
    for site in SITES:
        site.patch(family, module)
    if any(hasattr(module, name) for name in family.experts):  # the release has fused experts classes
        define_traced_op()  # the experts op a compiled graph runs, ready before any of its models is built
    pretrained = getattr(module, family.pretrained)
    if default_attention:
        set_once(pretrained, "get_correct_attn_implementation",
                 _attention_default(pretrained.get_correct_attn_implementation, family))
        if hasattr(pretrained, "_check_and_adjust_attn_implementation"):
            set_once(pretrained, "_check_and_adjust_attn_implementation",
                     _flash_checked(pretrained._check_and_adjust_attn_implementation, family))
    set_once(pretrained, "post_init", _announce_on_init(pretrained.post_init))


def enable(config: MindSpeedConfig | None = None) -> None:
    """Patch the kernels into every supported family and make `config` the process config (default: resolved
    from MINDSPEED_HF_CONFIG, the MINDSPEED_HF_* variables and the defaults): the settings of every model that was
    not given its own (a trainer gives its model the trainer's config). Idempotent; enabling again with another
    config only changes the process config.

    All or nothing: the releases and the config are checked before anything changes, and a failure while
    patching puts back everything this call patched or registered before it raises. (The package-level
    `mindspeed_hf.enable` adds the Trainer wiring on top: trainers/enabling.py.)"""
    from ..config import load_config
    from ..releases import supported

    outside = supported.unsupported()
    if outside:
        raise RuntimeError(f"mindspeed_hf: {'; '.join(outside)} is outside the supported range "
                           f"({supported.describe()}); install a supported release")
    given, config = config, config or load_config()
    # before any model is touched; the error names the variable when that is where the value came from
    registry.validate_backend_name(config.backend, "MINDSPEED_HF_BACKEND" if given is None and os.environ.get(
        "MINDSPEED_HF_BACKEND", "").strip().lower() == config.backend else "backend")
    if not is_enabled():
        try:
            register_attention()
            experts.register()
            for family in FAMILIES.values():
                _patch_family(family)
            diffusion.watch()  # diffusers' denoisers: each family when its module is imported
        except BaseException:
            _unpatch()
            raise
    _state["explicit"] = given
    registry.set_backend(config.backend)
    scope.set_process_config(config)


def _unpatch() -> None:
    """Put back every class and module symbol enable() patched, and its registrations and import watches."""
    third_party.stop_watching()
    _patches.restore_all()
    _fused_layers.clear()
    unregister_attention()
    experts.unregister()


def disable() -> None:
    """Restore every patched symbol exactly. Models keep working, unaccelerated."""
    if not is_enabled() and not len(_patches):
        return
    ours = set(OUR_ATTENTIONS)
    _unpatch()
    for model in list(_models):
        if compat.attn_implementation(model.config) in ours:
            _set_attention(model, "sdpa")
        experts.restore(model)
        linear_attention.restore(model)
        scope.detach(model)
        model.__dict__.pop("_mindspeed_ran", None)
    _models.clear()
    diffusion.release()
    registry.set_backend(None)
    scope.set_process_config(None)
    _state["explicit"] = None


def is_enabled() -> bool:
    return scope.process_config() is not None


def explicit_process_config() -> MindSpeedConfig | None:
    """The config enable() was given as an argument (None when it resolved its own)."""
    return _state["explicit"]


def active_config() -> MindSpeedConfig | None:
    """The process config (what enable() was called with), None while disabled."""
    return scope.process_config()


def apply_to_model(model: nn.Module, config: MindSpeedConfig | None = None) -> dict[str, Any]:
    """Accelerate an existing model (also PEFT-wrapped) with `config` (default: the process config): patch the
    families if not yet, attach the config to the model (it applies whenever this model runs, whatever other
    models use), make the attention ours unless it was requested explicitly, log one line, and return
    report(model). Unsupported models run unaccelerated with one warning per model type."""
    if not is_enabled():
        enable()
    config = config or scope.process_config()
    if find_hf_model(model) is None and diffusion.find_denoiser(model) is not None:
        return diffusion.apply_to_model(model, config)
    hf_model = find_hf_model(model)
    family = family_of(model)
    if family is None:
        model_type = getattr(getattr(hf_model, "config", None), "model_type", type(model).__name__)
        if model_type not in _state["warned_types"]:
            _state["warned_types"].add(model_type)
            logger.warning("mindspeed_hf: model type %r is not supported; it runs unaccelerated (supported: %s)",
                           model_type, ", ".join(sorted(FAMILIES)))
        return report(model)
    if family.modeling:  # a third-party module imported after enable()
        _patch_family(family)
    scope.attach(hf_model, config)
    _models.add(hf_model)
    current = compat.attn_implementation(hf_model.config)
    if current == ATTENTION_NAME and _sub_models_on(hf_model, "sdpa"):
        current = "sdpa"  # a nested sub-model left on sdpa (4.57's Qwen3-TTS code predictor built while enabled)
    if getattr(hf_model, "_mindspeed_explicit_attention", None) is None:
        if config.kernels.attention and current == "sdpa" and _replaceable(hf_model, family):
            _set_attention(hf_model, ATTENTION_NAME)
        elif not config.kernels.attention and current == ATTENTION_NAME:
            _set_attention(hf_model, "sdpa")
        hf_model.__dict__.pop("_mindspeed_explicit_attention", None)  # set_attn_implementation is ours, not theirs
    if family.experts:
        experts.settle(hf_model, config.kernels.experts)
    if family.linear_attention:
        linear_attention.settle(hf_model, family, _modeling(family))
    result = report(model)
    _announce(hf_model, result)
    return result


def _sub_models_on(model: nn.Module, name: str) -> bool:
    """Whether a PreTrainedModel nested inside `model` runs attention `name`."""
    from transformers import PreTrainedModel

    return any(sub is not model and isinstance(sub, PreTrainedModel) and compat.attn_implementation(sub.config) == name
               for sub in model.modules())


def _set_attention(model: nn.Module, name: str) -> None:
    """model.set_attn_implementation(name), and again on any sub-model it left behind (4.57 skips a nested
    sub-model whose config it changed before, e.g. Qwen3-TTS's code predictor inside the talker)."""
    from transformers import PreTrainedModel

    model.set_attn_implementation(name)
    left = ATTENTION_NAME if name != ATTENTION_NAME else "sdpa"
    for sub in model.modules():
        if sub is not model and isinstance(sub, PreTrainedModel) and compat.attn_implementation(sub.config) == left:
            sub.set_attn_implementation(name)


