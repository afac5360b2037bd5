"""The forwards that replace HF's module forwards. Each calls the model's own submodules and parameters, so
PEFT adapters, FSDP hooks and HF's casting rules keep working; only the math goes to a fused kernel. Every
function carries `_mindspeed_op` so report() can count what really runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.activations import SiLUActivation

from .. import compat
from ..ops.rms_norm import rms_norm
from ..ops.rotary import apply_rotary_pos_emb
from ..ops.swiglu import swiglu, swiglu_packed

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
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))

    return tag("swiglu", forward)


def packed_swiglu_mlp_forward(original: Callable) -> Callable:
    """Phi-3's gate_up_proj MLP: the packed projection feeds the kernel without a split."""

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.activation_fn, SILU):
            return original(self, hidden_states)
        return self.down_proj(swiglu_packed(self.gate_up_proj(hidden_states)))

    return tag("swiglu", forward)


def rope_forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any,
                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The modeling modules' `apply_rotary_pos_emb`, with every signature they have (see compat.rope_unsqueeze_dim)."""
    return apply_rotary_pos_emb(q, k, cos, sin, compat.rope_unsqueeze_dim(args, kwargs))


tag("rms_norm", rms_norm_forward)
tag("rms_norm", offset_rms_norm_forward)
rope_function = tag("rope", rope_forward)
