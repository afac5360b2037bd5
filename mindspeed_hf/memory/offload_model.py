"""Activation offload on a model: `memory.offload_activations`, `memory.offload_layers`, `memory.offload_min_bytes`.

Each decoder layer gets a per-instance subclass whose `__call__` runs the layer inside the model's
ActivationOffloader (memory/offload.py): outside the module hooks and outside any activation checkpoint, so the
checkpoint's own saves stay its own and only what the layer really keeps (with recompute on: the recompute
inputs) reaches the offload hooks. FSDP2, applied afterwards, subclasses the same instances again, so reshard and
offload work together. Every decoder layer is wrapped (a layer's start frees the previous layer's copies, and its
output's gradient prefetches it in backward); only the layers `offload_layers` picks, except the last, offload.
The forward itself is the class's own: nothing of the layer's code is copied.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
from torch import nn

from ..config import MemoryConfig
from .offload import ActivationOffloader
from .recompute import chosen_layers, decoder_layers

logger = logging.getLogger("mindspeed_hf")

_STATE = "_mindspeed_offload"  # instance attribute: (ActivationOffloader, layer index, offload or not)
_CLASSES: dict[type, type] = {}


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _offloaded_call(layer: nn.Module, call: Any, args: tuple, kwargs: dict) -> Any:
    state = layer.__dict__.get(_STATE)
    if state is None or not (layer.training and torch.is_grad_enabled()):
        return call(*args, **kwargs)
    offloader, index, offload = state
    with offloader.layer(index, offload) as current:
        output = call(*args, **kwargs)
    hidden = _first_tensor(output)
    if hidden is not None and hidden.requires_grad:
        hidden.register_hook(lambda grad: offloader.backward_reaches(current, index))
    return output


def _offload_class(cls: type) -> type:
    """The subclass of a decoder-layer class whose __call__ runs inside the offloader (one per class)."""
    if cls not in _CLASSES:
        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return _offloaded_call(self, partial(super(subclass, self).__call__), args, kwargs)

        # The same name: code that picks layers by class name (FSDP2's layer classes, accelerate's
        # transformer_layer_cls_to_wrap, _no_split_modules) still finds them.
        subclass = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                               "__qualname__": cls.__qualname__})
        _CLASSES[cls] = subclass
    return _CLASSES[cls]


def is_offload_layer(layer: nn.Module) -> bool:
    """True when `layer` runs inside an offloader (apply_offload_config wrapped it, FSDP2 may have since)."""
    return layer.__dict__.get(_STATE) is not None and any(isinstance(layer, sub) for sub in _CLASSES.values())


def offloader_of(model: nn.Module) -> ActivationOffloader | None:
    """The ActivationOffloader `apply_offload_config` installed on `model` (also through a PEFT wrapper)."""
    for layer in decoder_layers(model):
        state = layer.__dict__.get(_STATE)
        if state is not None:
            return state[0]
    return None


def remove_offload(model: nn.Module) -> None:
    """Take activation offload off `model`: every decoder layer back to its own class (or, once FSDP2 subclassed
    it, its call passing straight through)."""
    for layer in decoder_layers(model):
        layer.__dict__.pop(_STATE, None)
        base = next((c for c, sub in _CLASSES.items() if type(layer) is sub), None)
        if base is not None:
            layer.__class__ = base


def apply_offload_config(model: nn.Module, memory: MemoryConfig) -> ActivationOffloader | None:
    """Apply `memory.offload_*` to `model` (a transformers model or a PEFT wrapper of one) and return its
    offloader; applying again replaces what an earlier call did. Off leaves the model as it is."""
    if not memory.offload_activations:
        return None
    layers = decoder_layers(model)
    chosen = set(chosen_layers(memory.offload_layers, len(layers), "memory.offload_layers")) - {len(layers) - 1}
    remove_offload(model)
    if not chosen:  # nothing to offload: the layers stay as they are
        logger.warning("mindspeed_hf: activation offload asked for, but memory.offload_layers=%r leaves no decoder "
                       "layer of %d to offload (the last one is always kept)", memory.offload_layers, len(layers))
        return None
    offloader = ActivationOffloader(memory.offload_min_bytes)
    for index, layer in enumerate(layers):
        if not any(isinstance(layer, sub) for sub in _CLASSES.values()):
            layer.__class__ = _offload_class(type(layer))
        layer.__dict__[_STATE] = (offloader, index, index in chosen)
    logger.info("mindspeed_hf: activation offload is on (%d of %d decoder layers, saved tensors of at least %d "
                "bytes)", len(chosen), len(layers), memory.offload_min_bytes)
    return offloader
