"""SwiGLU: silu(gate) * up. The MLP forwards still go through the gate/up/down submodules (PEFT LoRA adapters on
them keep working); where the backend stacks plain projections (ops/linear.py) gate and up come from one matmul,
side by side in one tensor, which npu_swiglu then takes as it is."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..device import import_torch_npu
from .linear import halves_of_one
from .registry import register, run


@register("swiglu", "torch", name="torch")
def swiglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@register("swiglu", "npu", name="npu:npu_swiglu")
def swiglu_npu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    both = halves_of_one(gate, up)
    return import_torch_npu().npu_swiglu(torch.cat([gate, up], dim=-1) if both is None else both, dim=-1)


@register("swiglu", "cuda", name="cuda:liger_swiglu")
def swiglu_liger(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply(gate, up)


@register("swiglu_packed", "torch", name="torch")
def swiglu_packed_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@register("swiglu_packed", "npu", name="npu:npu_swiglu")
def swiglu_packed_npu(gate_up: torch.Tensor) -> torch.Tensor:
    return import_torch_npu().npu_swiglu(gate_up, dim=-1)


@register("swiglu_packed", "cuda", name="cuda:liger_swiglu")
def swiglu_packed_liger(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu_liger(gate, up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with the backend for the tensors' device."""
    return run("swiglu", gate.device)(gate, up)


def swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(first half) * second half of the last dim (Phi-3's fused gate_up projection)."""
    return run("swiglu_packed", gate_up.device)(gate_up)
