"""Recompute (activation checkpointing): `memory.recompute: false | full | selective`, `memory.recompute_modules`,
`memory.recompute_layers`.

- full: HF's own switch (non-reentrant activation checkpointing of whole decoder layers), then the layers outside
  `recompute_layers` switched back off one by one.
- selective: the parts of each chosen decoder layer named in `recompute_modules` recompute (selective.py); the
  rest of the layer keeps its activations.

`apply_recompute_config` is what parallel.parallelize's recompute step runs; `remove_recompute` takes selective
recompute off a model again. HF's own `gradient_checkpointing=True` (TrainingArguments) counts as `full` where no
source set memory.recompute (mindspeed_hf.config.sources.checkpointing_layer), and then mindspeed_hf applies it
(`absorb_hf_checkpointing`).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from ..config import MemoryConfig
from ..patches import diffusion
from ..releases.compat import (
    disable_activation_checkpointing,
    enable_activation_checkpointing,
    training_args_checkpointing_names,
)
from . import selective

logger = logging.getLogger("mindspeed_hf")

#: Direct children of a decoder layer that make up each recompute_modules choice, by attribute name.
_ATTENTION = ("self_attn",)
_MLP = ("mlp", "block_sparse_moe", "feed_forward")


def enable_recompute(model: nn.Module, announce: bool = True) -> bool:
    """Non-reentrant activation checkpointing of every decoder layer through HF's own switch (also through a PEFT
    wrapper). Returns False (with a warning) when the model has no such switch.

    Non-reentrant because the reentrant variant needs inputs that require grad (breaks frozen-base LoRA) and
    does not compose with FSDP2.
    """
    if not enable_activation_checkpointing(model, {"use_reentrant": False}):
        logger.warning("mindspeed_hf: recompute asked for, but %s has no activation checkpointing switch; it is off",
                       type(model).__name__)
        return False
    if announce:
        logger.info("mindspeed_hf: recompute is on (non-reentrant activation checkpointing on every decoder layer)")
    return True


def _full(model: nn.Module, memory: MemoryConfig, announce: bool = True) -> None:
    """Full recompute: every decoder layer checkpointed through HF's switch, then the layers outside
    recompute_layers switched back off."""
    layers = decoder_layers(model)
    chosen = chosen_layers(memory.recompute_layers, len(layers))
    denoiser = diffusion.find_denoiser(model)
    if denoiser is not None:  # diffusers switches checkpointing per model, not per block: each chosen block wrapped
        _whole_blocks(denoiser, [layers[i] for i in chosen], len(layers))
        return
    if enable_recompute(model, announce):
        for index, layer in enumerate(layers):
            layer.gradient_checkpointing = index in chosen


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (transformers' GradientCheckpointingLayer instances), in order; for a diffusers
    denoiser its transformer blocks (patches/diffusion: its family's, else the ones `_repeated_blocks` names)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if layers:
        return layers
    denoiser = diffusion.find_denoiser(model)
    return diffusion.denoiser_blocks(denoiser) if denoiser is not None else []


def chosen_layers(selection: str | int | list[int], count: int, setting: str = "memory.recompute_layers") -> list[int]:
    """The indices a layer selection (`setting`: memory.recompute_layers, memory.offload_layers) picks out of `count`
    layers; an index past the last one is an error naming `setting`."""
    if selection == "all":
        return list(range(count))
    if isinstance(selection, int):
        return list(range(0, count, selection))
    outside = [i for i in selection if i >= count]
    if outside:
        raise ValueError(f"{setting}={selection!r}: the model has {count} decoder layers; valid "
                         f"indices are 0..{count - 1}")
    return list(selection)


def layer_parts(layer: nn.Module, modules: list[str]) -> list[tuple[nn.Module, Any]]:
    """(part, checkpoint context_fn) for each part of `layer` that `modules` (recompute_modules) names (a diffusers
    block's: its attention modules, feed-forwards and norms, diffusion.block_parts)."""
    children = dict(layer.named_children())
    found = diffusion.block_parts(layer) if not any(n in children for n in (*_ATTENTION, *_MLP)) else None
    parts: list[tuple[nn.Module, Any]] = []
    if "self_attn" in modules or "attention_core" in modules:
        context = None if "self_attn" in modules else selective.ATTENTION_CORE_CONTEXT
        attention = found["attention"] if found else [children[n] for n in _ATTENTION if n in children]
        parts += [(part, context) for part in attention]
    if "mlp" in modules:
        parts += [(part, None) for part in (found["mlp"] if found else [children[n] for n in _MLP if n in children])]
    if "norms" in modules:
        norms = found["norms"] if found else [child for name, child in children.items() if name.endswith("norm")]
        parts += [(part, None) for part in norms]
    return parts


def remove_recompute(model: nn.Module) -> None:
    """Take selective recompute off `model` (every part back to its own forward)."""
    for module in model.modules():
        selective.unwrap(module)


def hf_checkpointing_on(model: nn.Module | None) -> bool:
    """Whether HF's own gradient checkpointing is switched on anywhere in `model`: what transformers'
    `is_activation_checkpointing` (`is_gradient_checkpointing` before 5.x, now a deprecated alias that warns) and
    diffusers' `is_gradient_checkpointing` compute, read without the deprecation warning."""
    return model is not None and any(bool(getattr(m, "gradient_checkpointing", False)) for m in model.modules())


def _layer_checkpointing_on(model: nn.Module) -> bool:
    return any(getattr(layer, "gradient_checkpointing", False) for layer in decoder_layers(model))


def apply_recompute_config(model: nn.Module, memory: MemoryConfig) -> None:
    """Apply `memory.recompute*` to `model` (a transformers model or a PEFT wrapper of one); applying again
    replaces what an earlier call did. `off` leaves the model as it is."""
    mode = memory.recompute_mode
    if mode == "off":
        return
    remove_recompute(model)
    if mode == "full":
        _full(model, memory)
        return
    layers = decoder_layers(model)
    chosen = chosen_layers(memory.recompute_layers, len(layers))
    if _layer_checkpointing_on(model) or _denoiser_checkpointing_on(model):
        logger.info("mindspeed_hf: selective recompute replaces the whole-layer checkpointing that was on")
        disable_activation_checkpointing(model)
        _denoiser_checkpointing_off(model)
    wrapped = 0
    for index in chosen:
        for part, context in layer_parts(layers[index], memory.recompute_modules):
            selective.wrap(part, context)
            wrapped += 1
    if not wrapped:
        logger.warning("mindspeed_hf: selective recompute asked for, but %s has no %s in its decoder layers; "
                       "nothing recomputes", type(model).__name__, ", ".join(memory.recompute_modules))
        return
    logger.info("mindspeed_hf: recompute is on (selective: %s in %d of %d decoder layers)",
                ", ".join(memory.recompute_modules), len(chosen), len(layers))


def _denoiser_checkpointing_on(model: nn.Module) -> bool:
    return hf_checkpointing_on(diffusion.find_denoiser(model))


def _denoiser_checkpointing_off(model: nn.Module) -> None:
    """diffusers' own (model-wide) gradient checkpointing off: ours replaces it."""
    if _denoiser_checkpointing_on(model):
        diffusion.find_denoiser(model).disable_gradient_checkpointing()


def _whole_blocks(denoiser: nn.Module, chosen: list[nn.Module], count: int) -> None:
    """memory.recompute=full on a diffusers denoiser: the chosen blocks recompute whole (non-reentrant), in place
    of diffusers' own checkpointing, which covers every block or none."""
    if _denoiser_checkpointing_on(denoiser):
        logger.info("mindspeed_hf: recompute=full replaces diffusers' own gradient checkpointing (every block) with "
                    "the chosen blocks")
        _denoiser_checkpointing_off(denoiser)
    for block in chosen:
        selective.wrap(block)
    logger.info("mindspeed_hf: recompute is on (full: %d of %d transformer blocks)", len(chosen), count)


# ----------------------------------------------------------------------------- HF's own gradient_checkpointing
_ENABLES = ("activation_checkpointing_enable", "gradient_checkpointing_enable")


def _ours_again(target: nn.Module, memory: MemoryConfig):
    """Stands for HF's checkpointing switch on a model mindspeed_hf applied memory.recompute to: Trainer.train's call
    changes nothing; a caller that switched checkpointing off and calls it to switch it back on (TRL's DPO, around
    its no-grad reference forward, every step) gets ours back as it was, not nothing (whole-layer recompute then
    stayed off for the rest of training: measured +96 MB of step memory in bench_trl's DPO) nor HF's with other
    kwargs. Selective recompute is not touched by HF's switch."""

    def enable(*_: Any, **__: Any) -> None:
        if memory.recompute_mode != "full" or _layer_checkpointing_on(target):
            return
        own = {name: vars(target).pop(name) for name in _ENABLES if name in vars(target)}
        try:  # the class's own switch underneath
            _full(target, memory, announce=False)
        finally:
            vars(target).update(own)

    return enable


def absorb_hf_checkpointing(model: nn.Module, args: Any, memory: MemoryConfig) -> None:
    """When mindspeed_hf applied recompute to the trainer's model itself (before sharding, non-reentrant, only the
    chosen layers or parts) and TrainingArguments' own switch is on too, Trainer.train would checkpoint every whole
    layer again on top: make that call a no-op on this model (the arguments are left as the user wrote them, so
    the copy saved in checkpoints is theirs)."""
    switch, kwargs = training_args_checkpointing_names()
    if args is None or not getattr(args, switch, False) or memory.recompute_mode == "off":
        return
    if getattr(args, kwargs, None):
        logger.info("mindspeed_hf: %s=%r are not used: mindspeed_hf's recompute is non-reentrant", kwargs,
                    getattr(args, kwargs))
    logger.info("mindspeed_hf: %s=True is applied by mindspeed_hf as memory.recompute=%s", switch,
                memory.recompute_mode)
    target = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    enable = _ours_again(target, memory)
    for name in _ENABLES:
        if hasattr(target, name):
            setattr(target, name, enable)
