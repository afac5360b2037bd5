"""Applying the family table: enable() patches classes and module functions (models built before and after),
apply_to_model() settles one existing model (PEFT-wrapped too), disable() restores every original, and report()
says what really runs on a given model."""

from __future__ import annotations

import functools
import importlib
import logging
import weakref
from typing import Any

import torch
from torch import nn

from ..config import MindSpeedConfig
from ..ops import registry
from ..ops.attention import ATTENTION_NAME, register_attention, unregister_attention
from . import forwards
from .engine import PatchSet
from .families import FAMILIES, ModelFamily

logger = logging.getLogger("mindspeed_hf")

_OPS = ("rms_norm", "rope", "swiglu", "attention", "fused_linear_cross_entropy")

_patches = PatchSet()
_state: dict[str, Any] = {"config": None, "warned_types": set()}
# Models whose attention may point at our kernel: disable() switches them back to sdpa.
_models: weakref.WeakSet = weakref.WeakSet()


def _modeling(family: ModelFamily):
    try:
        return importlib.import_module(family.modeling_module)
    except ImportError:  # an older transformers without this family
        return None


def _attention_default(original):
    """Wrap XPreTrainedModel.get_correct_attn_implementation: the default (sdpa) becomes our kernel."""

    @functools.wraps(original)
    def get_correct_attn_implementation(self, requested_attention=None, is_init_check=False):
        if requested_attention in (None, "sdpa") and self._supports_sdpa:
            requested_attention = ATTENTION_NAME
        return original(self, requested_attention, is_init_check)

    return get_correct_attn_implementation


def _announce_on_init(original):
    """Wrap XPreTrainedModel.post_init to log one line per top-level model built while enabled."""

    @functools.wraps(original)
    def post_init(self):
        original(self)
        _models.add(self)
        if getattr(self, "base_model", self) is not self:  # the top-level model, not its inner base model
            _announce(self, report(self))

    return post_init


def _patch_family(family: ModelFamily, config: MindSpeedConfig) -> None:
    module = _modeling(family)
    if module is None:
        return
    kernels = config.kernels
    if kernels.rms_norm:
        norm_forward = forwards.offset_rms_norm_forward if family.offset_rms_norm else forwards.rms_norm_forward
        for name in family.rms_norm:
            _patches.set(getattr(module, name), "forward", norm_forward)
    if kernels.swiglu:
        for names, make in ((family.swiglu_mlp, forwards.swiglu_mlp_forward),
                            (family.packed_swiglu_mlp, forwards.packed_swiglu_mlp_forward)):
            for name in names:
                cls = getattr(module, name)
                if not _patches.is_patched(cls, "forward"):
                    _patches.set(cls, "forward", make(cls.forward))
    if kernels.rope and family.rope:
        _patches.set(module, "apply_rotary_pos_emb", forwards.rope_function)
    pretrained = getattr(module, family.pretrained)
    if kernels.attention and not _patches.is_patched(pretrained, "get_correct_attn_implementation"):
        _patches.set(pretrained, "get_correct_attn_implementation",
                     _attention_default(pretrained.get_correct_attn_implementation))
    if not _patches.is_patched(pretrained, "post_init"):
        _patches.set(pretrained, "post_init", _announce_on_init(pretrained.post_init))
    if kernels.fused_linear_cross_entropy:
        from . import causal_lm

        forward = forwards.tag("fused_linear_cross_entropy", causal_lm.causal_lm_forward)
        for name in family.causal_lm:
            _patches.set(getattr(module, name), "forward", forward)


def enable(config: MindSpeedConfig | None = None) -> None:
    """Patch every supported family for the kernels `config` enables (default: MINDSPEED_HF_CONFIG / defaults).

    Idempotent; enabling again with another config first restores the originals.
    """
    from ..config import load_config

    config = config or load_config()
    if _state["config"] is not None:
        if _state["config"] == config:
            return
        disable()
    registry.set_backend(config.backend)  # validated here, before any model is touched
    if config.kernels.attention:
        register_attention()
    if config.kernels.fused_linear_cross_entropy:
        from . import causal_lm

        causal_lm.configure(enabled=True, chunk_size=config.kernels.loss_chunk_size)
    for family in FAMILIES.values():
        _patch_family(family, config)
    from ..trainers import wiring

    wiring.install_trainer_wiring()
    _state["config"] = config


def disable() -> None:
    """Restore every patched symbol exactly. Models keep working, unaccelerated."""
    if _state["config"] is None and not len(_patches):
        return
    from ..trainers import wiring

    wiring.uninstall_trainer_wiring()
    _patches.restore_all()
    for model in list(_models):
        if model.config._attn_implementation == ATTENTION_NAME:
            model.set_attn_implementation("sdpa")
    _models.clear()
    unregister_attention()
    registry.set_backend(None)
    _state["config"] = None


def is_enabled() -> bool:
    return _state["config"] is not None


def active_config() -> MindSpeedConfig | None:
    return _state["config"]


def find_hf_model(model: nn.Module) -> nn.Module | None:
    """The transformers PreTrainedModel inside `model` (itself, or under PEFT / DDP / FSDP wrappers)."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel) and not hasattr(model, "get_base_model"):
        return model
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def family_of(model: nn.Module) -> ModelFamily | None:
    hf_model = find_hf_model(model)
    return None if hf_model is None else FAMILIES.get(getattr(hf_model.config, "model_type", None))


def apply_to_model(model: nn.Module, config: MindSpeedConfig | None = None) -> dict[str, Any]:
    """Accelerate an existing model (also PEFT-wrapped): patch its family if not yet, switch its attention to our
    kernel (from the default sdpa), log one line, and return report(model). Unsupported models run unaccelerated
    with one warning per model type."""
    config = config or _state["config"]
    if config is None:
        from ..config import load_config

        config = load_config()
    hf_model = find_hf_model(model)
    family = family_of(model)
    if family is None:
        model_type = getattr(getattr(hf_model, "config", None), "model_type", type(model).__name__)
        if model_type not in _state["warned_types"]:
            _state["warned_types"].add(model_type)
            logger.warning("mindspeed_hf: model type %r is not supported; it runs unaccelerated (supported: %s)",
                           model_type, ", ".join(sorted(FAMILIES)))
        return report(model)
    if not is_enabled():
        enable(config)
    if config.kernels.attention and hf_model.config._attn_implementation == "sdpa":
        hf_model.set_attn_implementation(ATTENTION_NAME)
        _models.add(hf_model)
    result = report(model)
    _announce(hf_model, result)
    return result


def _model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    if param is None:
        return torch.device("cpu")
    if param.device.type == "meta":  # built on meta, to be materialised on this process's accelerator
        from ..device import detect_device_type

        return torch.device(detect_device_type())
    return param.device


def report(model: nn.Module) -> dict[str, Any]:
    """What really runs on `model`: the kernel backend, the number of patched sites per op, and the
    implementation of each op on the model's device."""
    device = _model_device(model)
    hf_model = find_hf_model(model)
    family = family_of(model)
    counts = dict.fromkeys(_OPS, 0)
    if family is not None:
        module = _modeling(family)
        rope_patched = getattr(module, "apply_rotary_pos_emb", None) is forwards.rope_function
        attention_ours = hf_model.config._attn_implementation == ATTENTION_NAME
        for sub in hf_model.modules():
            forward = vars(sub).get("forward", type(sub).forward)
            op = getattr(forward, "_mindspeed_op", None)
            if op is not None:
                counts[op] += 1
            if type(sub).__name__ == family.attention:
                counts["rope"] += rope_patched
                counts["attention"] += attention_ours
    return {
        "model_type": getattr(getattr(hf_model, "config", None), "model_type", None),
        "backend": registry.resolve_backend(device),
        "kernels": counts,
        "implementations": {op: registry.implementation(op, device) for op in _OPS if op in registry.registered_ops()},
    }


def _announce(model: nn.Module, result: dict[str, Any]) -> None:
    """Log what was applied, once per model (and again only if it changed)."""
    applied = ", ".join(f"{op} x{n}" for op, n in result["kernels"].items() if n) or "nothing"
    line = f"mindspeed_hf: {result['model_type']} on backend {result['backend']}: {applied}"
    if getattr(model, "_mindspeed_announced", None) != line:
        model._mindspeed_announced = line
        logger.info(line)
