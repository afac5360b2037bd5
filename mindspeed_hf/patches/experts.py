"""The routed-experts kernel as a transformers experts implementation (transformers >= 5).

transformers 5 keeps each MoE block's experts as fused 3-D parameters (`gate_up_proj [E, 2I, H]`, `down_proj
[E, H, I]`) in a class decorated with `use_experts_implementation`, whose forward runs the function that
`config._experts_implementation` names in `ALL_EXPERTS_FUNCTIONS` (default `grouped_mm`). We register ours under
EXPERTS_NAME and make it the default the same way our attention becomes the default: the family's
`get_correct_experts_implementation` answers EXPERTS_NAME when nothing was requested and the current config has
kernels.experts on, and remembers an explicit request (`experts_implementation="eager"`, ...), which is kept.
The registered function asks the running model's config (scope.switch) and runs HF's default where it is off,
and on the torch backend, where HF's default (`grouped_mm`) is our torch kernel's algorithm (`hf_runs_them`).

Biased experts, transposed weights and a family's own gate (GPT-OSS: [E, H, 2I] weights with biases, an
interleaved clamped gate) run through grouped_mlp's keywords; experts it does not cover (no gate, a post-expert
norm, DTensor weights of transformers' own expert parallelism) run HF's default implementation.

The router stays HF's: `npu_moe_gating_top_k_softmax` has no backward (documented for inference), so a training
router cannot run on it, and its tie order against torch.topk is unspecified.

transformers 4.57 has no experts registry (and most of its MoE blocks hold one module per expert): there the kernel
does not apply, and report() says so.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..ops import registry
from ..ops.experts import experts_mlp
from ..releases import compat
from . import forwards, scope

logger = logging.getLogger("mindspeed_hf")

#: The two 3-D parameters of a fused experts module (transformers 5's layout).
FUSED_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def find_fused_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every fused experts module: 3-D ``gate_up_proj`` and ``down_proj`` parameters, in order."""
    found = []
    for name, module in model.named_modules():
        weights = [getattr(module, w, None) for w in FUSED_EXPERT_WEIGHTS]
        if all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights):
            found.append((name, module))
    return found


EXPERTS_NAME = "mindspeed"
UNAVAILABLE = ("not applied: this transformers release has no experts implementation to choose (4.57) or accepts "
               "only its own (5.0 to 5.9); needs >= 5.10")
_state: dict[str, Any] = {"registered": None, "warned_old": False}


def _default_gate(module: nn.Module) -> bool:
    """True when the module's gate is act_fn(first half) * second half with a SiLU act_fn (the fused swiglu)."""
    registry = compat.experts_registry()
    gate = getattr(type(module), "_apply_gate", None)
    return gate is registry.default_apply_gate and isinstance(getattr(module, "act_fn", None), forwards.SILU)


def gate_of(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """grouped_mlp's `apply_gate` for this experts module: None for the plain SiLU gate (the fused swiglu), else
    the module's own `_apply_gate`."""
    return None if _default_gate(module) else module._apply_gate


def _layout(module: nn.Module) -> dict[str, Any] | None:
    """grouped_mlp's layout keywords for this experts module, or None where our kernel does not compute exactly what
    its eager forward does (no gate, a post-expert norm, DTensor weights, unexpected shapes)."""
    transposed = bool(getattr(module, "is_transposed", False))
    names = (*FUSED_EXPERT_WEIGHTS, *(("gate_up_proj_bias", "down_proj_bias")
                                      if getattr(module, "has_bias", False) else ()))
    tensors = [getattr(module, name, None) for name in names]
    if not all(isinstance(t, torch.Tensor) and not isinstance(t, DTensor) for t in tensors):
        return None
    if not getattr(module, "has_gate", False) or getattr(module, "has_post_expert_norm", False):
        return None
    gate_up, down = tensors[0], tensors[1]
    if gate_up.dim() != 3 or down.dim() != 3:
        return None
    (_, k_up, n_up), (_, k_down, n_down) = (
        (gate_up.shape, down.shape) if transposed else (gate_up.transpose(1, 2).shape, down.transpose(1, 2).shape))
    if n_up != 2 * k_down or n_down != k_up:
        return None
    biases = tensors[2:] or (None, None)
    if biases[0] is not None and (tuple(biases[0].shape) != (gate_up.shape[0], n_up)
                                  or tuple(biases[1].shape) != (gate_up.shape[0], n_down)):
        return None
    return {"gate_up_bias": biases[0], "down_bias": biases[1], "transposed": transposed}


def fits(module: nn.Module) -> bool:
    """Whether our kernel computes exactly what this experts module's eager forward does."""
    return _layout(module) is not None


HF_GROUPED = ("HF's grouped_mm on the torch backend: transformers' default experts implementation runs the same "
              "torch._grouped_mm over the permuted rows as our torch kernel, with less Python around it")


def hf_runs_them(backend: str) -> bool:
    """Whether HF's own default experts implementation runs instead of ours on `backend` (the resolved one): on the
    torch backend (the CPU reference), where transformers' default is `grouped_mm`, the algorithm of our torch
    kernel. The device backends keep their kernels."""
    found = compat.experts_registry()
    return backend == "torch" and found is not None and found.default_name == "grouped_mm"


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts forward (HF's signature): permute -> grouped gate_up -> gate -> grouped down -> weighted
    unpermute, on the backend's kernels (ops/experts.py); HF's default where `hf_runs_them`."""
    layout = None if hf_runs_them(registry.resolve_backend(hidden_states.device)) else _layout(self)
    if layout is None:
        return compat.experts_registry().default(self, hidden_states, top_k_index, top_k_weights)
    out = experts_mlp(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, gate_of(self),
                      **layout)
    return out.to(hidden_states.dtype)


def available() -> bool:
    """The installed transformers has the experts registry (>= 5)."""
    return compat.experts_registry() is not None


def register() -> None:
    """Add EXPERTS_NAME to ALL_EXPERTS_FUNCTIONS (runs HF's default wherever the current config has experts off)."""
    registry = compat.experts_registry()
    if registry is None or _state["registered"] is not None:
        return
    fn = scope.switch("experts", experts_forward, registry.default)
    registry.functions.register(EXPERTS_NAME, fn)
    _state["registered"] = fn


def unregister() -> None:
    registry = compat.experts_registry()
    if registry is not None and _state["registered"] is not None:
        compat.unregister(registry.functions, EXPERTS_NAME)
    _state["registered"] = None


def default_wrapper(original):
    """Wrap XPreTrainedModel.get_correct_experts_implementation: no request becomes ours while the current config
    has experts on; an explicit request of another implementation is kept and remembered."""

    @functools.wraps(original)
    def get_correct_experts_implementation(self, requested_experts=None):
        if requested_experts is None:
            if scope.kernel_on("experts") and self._can_set_experts_implementation():
                requested_experts = EXPERTS_NAME
        elif requested_experts != EXPERTS_NAME:
            self._mindspeed_explicit_experts = requested_experts
        return original(self, requested_experts)

    return get_correct_experts_implementation


def _current(hf_model: nn.Module) -> str | None:
    return compat.experts_implementation(hf_model.config)


def settle(hf_model: nn.Module, on: bool) -> None:
    """apply_to_model: make an existing model's experts ours (on) or HF's default (off), unless it asked for one."""
    registry = compat.experts_registry()
    if registry is None or not hf_model._can_set_experts_implementation():
        return
    if getattr(hf_model, "_mindspeed_explicit_experts", None) is not None:
        return
    current = _current(hf_model)
    if on and current == registry.default_name:
        hf_model.set_experts_implementation(EXPERTS_NAME)
    elif not on and current == EXPERTS_NAME:
        hf_model.set_experts_implementation(registry.default_name)
    hf_model.__dict__.pop("_mindspeed_explicit_experts", None)  # set_experts_implementation is ours, not theirs


def restore(hf_model: nn.Module) -> None:
    """disable(): a model running our experts goes back to HF's default implementation."""
    registry = compat.experts_registry()
    if registry is not None and _current(hf_model) == EXPERTS_NAME:
        hf_model.set_experts_implementation(registry.default_name)


def count(hf_model: nn.Module, classes: tuple[type, ...], on: bool) -> int:
    """Experts modules of `hf_model` that run our kernel."""
    if not on or not classes or _current(hf_model) != EXPERTS_NAME:
        return 0
    return sum(isinstance(m, classes) and fits(m) for m in hf_model.modules())


def describe(hf_model: nn.Module, moe: bool) -> str | None:
    """What report()'s `kept` says about the experts of a MoE model that does not run ours (None: nothing to say)."""
    if not moe:
        return None
    if not available():
        if not _state["warned_old"]:
            _state["warned_old"] = True
            logger.info("mindspeed_hf: experts kernel %s", UNAVAILABLE)
        return UNAVAILABLE
    explicit = getattr(hf_model, "_mindspeed_explicit_experts", None)
    current = _current(hf_model)
    if explicit is not None and current != EXPERTS_NAME:
        return f"{current} (requested explicitly)"
    return None
