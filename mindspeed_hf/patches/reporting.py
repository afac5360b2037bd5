"""What really runs on a model: report() (patched sites per op, the implementation of each op on the model's device,
what ran), replacements() (where other code replaced our kernels) and the one log line per model; with the lookups
they share with patches/apply.py (a model's transformers model, its family, its family's modeling module)."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from ..device import model_device
from ..ops import registry
from ..ops.attention import OUR_ATTENTIONS
from ..ops.rms_norm import add_rms_norm_fuses
from ..releases import compat
from . import choice, experts, multimodal, quantized, scope, third_party
from .engine import FUSED_LAYERS, PATCHES
from .families import FAMILIES, ModelFamily, family_for
from .sites import OPS, REPORTED_AS


def modeling(family: ModelFamily):
    """The modeling module of `family` (None: its package is not imported, or this release lacks it)."""
    if family.modeling:  # third-party: only once its package is imported (never imported from here)
        return third_party.imported_module(family.modeling)
    try:
        return importlib.import_module(family.modeling_module)
    except ImportError:  # an older transformers without this family
        return None


def find_hf_model(model: nn.Module) -> nn.Module | None:
    """The transformers PreTrainedModel inside `model` (itself, or under PEFT / DDP / FSDP wrappers)."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel) and not hasattr(model, "get_base_model"):
        return model
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def family_of(model: nn.Module) -> ModelFamily | None:
    """The table entry of `model`'s transformers model (None: no entry)."""
    hf_model = find_hf_model(model)
    if hf_model is None:
        return None
    return family_for(getattr(hf_model.config, "model_type", None), tuple(c.__name__ for c in type(hf_model).__mro__))


def report(model: nn.Module) -> dict[str, Any]:
    """What really runs on `model`: the kernel backend, the number of patched sites per op, and the
    implementation of each op on the model's device."""
    device = model_device(model)
    hf_model = find_hf_model(model)
    if hf_model is None:
        from .diffusion import find_denoiser
        from .diffusion import report as denoiser_report

        if find_denoiser(model) is not None:  # a diffusers image / video denoiser
            return denoiser_report(model)
    family = family_of(model)
    counts = dict.fromkeys(OPS, 0)
    vision = dict.fromkeys(multimodal.VISION_OPS, 0)
    audio = {"attention": 0}
    kept: dict[str, str] = {}
    layers = 0
    config = scope.config_of(hf_model) if hf_model is not None else None
    running = scope.running_config_of(hf_model) if hf_model is not None else None
    if family is not None and scope.process_config() is not None:  # enabled
        module = modeling(family)
        text_attention = multimodal.text_attention_sites(family, module, hf_model, FAMILIES, modeling)
        rope_ours = getattr(getattr(module, "apply_rotary_pos_emb", None), "_mindspeed_op", None) == "rope"
        text_attention.update({getattr(module, name): rope_ours for name in family.more_attention
                               if hasattr(module, name)})
        vision_ids, vision_attention, vision_rope = multimodal.vision_sites(family, module, hf_model)
        audio_ids = multimodal.tower_modules(module, hf_model, family.audio_model)
        mrope = {getattr(module, cls): getattr(getattr(module, fn), "_mindspeed_op", None) == "rope"
                 for cls, fn in family.mrope_attention}
        on = {op: bool(getattr(running.kernels, op)) for op in OPS}
        attention = compat.attn_implementation(hf_model.config)
        explicit = getattr(hf_model, "_mindspeed_explicit_attention", None)
        if explicit is not None and attention not in OUR_ATTENTIONS:
            kept["attention"] = f"{attention} (requested explicitly)"
        experts_classes = tuple(getattr(module, name) for name in family.experts if hasattr(module, name))
        counts["experts"] = experts.count(hf_model, experts_classes, on["experts"])
        experts_note = experts.describe(hf_model, bool(family.experts))
        if experts_note is not None:
            kept["experts"] = experts_note
        for sub in hf_model.modules():
            op = _running_op(sub)
            ours = compat.attn_implementation(getattr(sub, "config", hf_model.config)) in OUR_ATTENTIONS
            if isinstance(sub, vision_attention):  # the tower's: counted apart (report()["vision_kernels"])
                vision["attention"] += op is not None and on[op] and ours
                vision["rope"] += vision_rope and on["rope"]
                continue
            if id(sub) in audio_ids:  # the Omni audio tower's: report()["audio_kernels"]
                audio["attention"] += op == "attention" and on[op] and ours
                continue
            if op == "add_rms_norm" or (op is None and isinstance(sub, tuple(FUSED_LAYERS))):  # fused add
                layers += on["rms_norm"]
            elif op is not None and op in counts:  # (stacked_linear: in "ran" and "implementations" only)
                (vision if id(sub) in vision_ids else counts)[op] += on[op]
            rope_patched = next((r for cls, r in text_attention.items() if isinstance(sub, cls)), None)
            if rope_patched is not None:
                counts["rope"] += rope_patched and on["rope"]
                counts["attention"] += ours
            elif type(sub) in mrope:
                counts["rope"] += mrope[type(sub)] and on["rope"]
                counts["attention"] += compat.attn_implementation(sub.config) in OUR_ATTENTIONS
    token = registry.use_backend(None if config is None or config.backend == "auto" else config.backend)
    try:
        ran, fallbacks = registry.split_fallbacks(scope.ran(hf_model)) if hf_model is not None else ({}, {})
        if counts["experts"] and experts.hf_runs_them(registry.resolve_backend(device)):
            counts["experts"], kept["experts"] = 0, experts.HF_GROUPED
        return {
            "model_type": family.model_type if family is not None else getattr(getattr(hf_model, "config", None),
                                                                                "model_type", None),
            "backend": registry.resolve_backend(device),
            "kernels": counts,
            "implementations": {op: registry.implementation(op, device) for op in (*OPS, *REPORTED_AS)
                                if op in registry.registered_ops()},
            # decoder layers whose residual add runs fused into the norm after it (none on a backend without an
            # add+norm kernel: HF's layer forward runs there, ops.rms_norm.add_rms_norm_fuses)
            "add_rms_norm_layers": layers if add_rms_norm_fuses(device) else 0,
            "attention_implementation": compat.attn_implementation(getattr(hf_model, "config", None)),
            "skip_logits": None if config is None or not counts["fused_linear_cross_entropy"] else
            config.kernels.skip_logits,
            "kept": kept,
            # ops whose kernel the config asks for but HF's own code runs, ours gaining nothing here (patches/choice.py)
            "hf_path": choice.hf_path(config, running) if family is not None and config is not None else {},
            # what really ran on this model since it was built (or accelerated): executions per op
            "ran": {**dict.fromkeys((*OPS, *REPORTED_AS, "vision_attention"), 0), **ran}
            if hf_model is not None else {},
            # calls a device kernel handed to the torch path (the warning names why): not counted in "ran"
            "fallbacks": fallbacks,
            "quantized_linear": quantized.describe(model, device),
            **({"vision_kernels": vision, "vision_attention_implementation": registry.implementation(
                "vision_attention", device)} if family is not None and family.vision_model else {}),
            **({"audio_kernels": audio} if family is not None and family.audio_model else {}),
        }
    finally:
        registry.reset_backend(token)


def replacements(model: nn.Module) -> dict[str, str]:
    """Where other code has replaced our kernels since enable() (another kernel library patching the same classes
    or module functions, or the forwards of this model's modules): `where (by package)` -> the op it replaced."""
    found = {}
    for patch in PATCHES.replaced():
        op = _op_of(patch.value)
        if op is not None:
            now = getattr(patch.owner, patch.name, None)
            where = getattr(patch.owner, "__qualname__", None) or getattr(patch.owner, "__name__", str(patch.owner))
            found[f"{where}.{patch.name} (by {getattr(now, '__module__', None) or 'unknown code'})"] = op
    for sub in model.modules():
        forward = vars(sub).get("forward")
        op = _op_of(type(sub).forward)
        if forward is not None and op is not None and _running_op(sub) is None:
            found[f"{type(sub).__name__}.forward of the model (by {getattr(forward, '__module__', None)})"] = op
    return found


def _running_op(module: nn.Module) -> str | None:
    """The op of the forward that runs for `module`: its instance forward's, or its class's when the instance
    forward is a transparent wrapper (marked `_mindspeed_transparent`: it runs the class's forward, e.g. selective
    recompute's)."""
    forward = vars(module).get("forward")
    if forward is None or getattr(forward, "_mindspeed_transparent", False):
        return _op_of(type(module).forward)
    return _op_of(forward)


def _op_of(forward: Any) -> str | None:
    """The op a module's forward runs (its `_mindspeed_op`), looking through wrappers that keep `__wrapped__`, such
    as the one accelerate puts on the instance for bf16/fp16 mixed precision (autocast + convert_to_fp32)."""
    for _ in range(8):
        op = getattr(forward, "_mindspeed_op", None)
        if op is not None or not hasattr(forward, "__wrapped__"):
            return op
        forward = forward.__wrapped__
    return None
