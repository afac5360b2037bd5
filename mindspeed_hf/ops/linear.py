"""Projections of one input through several nn.Linear layers (attention's q/k/v, an MLP's gate/up) as ONE matmul
over their weights stacked along the output dimension, where fewer, larger kernels pay: on npu. Elsewhere (and for
any layer that is not a plain nn.Linear: a PEFT adapter, a quantized or sharded layer, hooks on it) each layer runs
as HF runs it. The parameters stay the model's own (state dict, optimizer, LoRA targets unchanged); the stacking
is a concatenation per call (made again in the backward rather than kept), and each weight gets its slice of one
weight-gradient matmul.

The outputs of the stacked call are views (`split`) of one tensor: `halves_of_one` lets a kernel that wants two of
them side by side (npu_swiglu's [gate | up]) take that tensor without a copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..releases import compat
from .registry import has_own_kernel, register, run


def _plain(layer: object, like: nn.Linear) -> bool:
    """An nn.Linear (the class itself) that runs exactly `F.linear(x, weight, bias)` when called: no hooks, no
    instance forward, weights that are plain tensors (not DTensor / DeepSpeed-partitioned) like `like`'s."""
    if type(layer) is not nn.Linear or "forward" in vars(layer) or layer._forward_hooks or layer._forward_pre_hooks:
        return False
    weight, bias = layer.weight, layer.bias
    return (type(weight) in (nn.Parameter, torch.Tensor) and not hasattr(weight, "ds_id")
            and weight.dtype == like.weight.dtype and weight.device == like.weight.device
            and (bias is None) == (like.bias is None)
            and (bias is None or (type(bias) in (nn.Parameter, torch.Tensor) and bias.dtype == weight.dtype)))


def stackable(x: torch.Tensor, layers: Sequence[object]) -> bool:
    """Whether `layers` (all called on `x`) can run as one stacked matmul with the same result: plain nn.Linear
    layers of one input size, dtype and device, no global module hooks, not while torch.compile traces."""
    if len(layers) < 2 or not isinstance(layers[0], nn.Linear) or torch.compiler.is_compiling():
        return False
    if compat.global_module_hooks():
        return False
    first = layers[0]
    return all(_plain(layer, first) and layer.weight.shape[1:] == first.weight.shape[1:] for layer in layers)


def _separate(x: torch.Tensor, layers: Sequence[nn.Linear]) -> tuple[torch.Tensor, ...]:
    return tuple(layer(x) for layer in layers)


class _StackedLinear(torch.autograd.Function):
    """x @ cat(weights).T (+ cat(biases)) -> the concatenated output. Saves the input and the parameters
    themselves, not the concatenated weight (a copy of them: as large as the weights, per layer), which the
    backward builds again for the input's gradient and frees."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, *params: torch.Tensor) -> torch.Tensor:
        weights, biases = params[:n], params[n:]
        ctx.has_bias = bool(biases)
        ctx.save_for_backward(x, *weights)
        return F.linear(x, torch.cat(weights), torch.cat(biases) if biases else None)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        grad_x = grad @ torch.cat(weights) if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[2:]):  # every weight and bias frozen
            return (grad_x, None, *[None] * (len(ctx.needs_input_grad) - 2))
        flat = grad.reshape(-1, grad.shape[-1])
        sizes = [w.shape[0] for w in weights]
        grad_w = (flat.t() @ x.reshape(-1, x.shape[-1])).split(sizes)
        grad_b = flat.sum(0).split(sizes) if ctx.has_bias else ()
        return (grad_x, None, *grad_w, *grad_b)


def _stacked(x: torch.Tensor, layers: Sequence[nn.Linear]) -> tuple[torch.Tensor, ...]:
    params = [layer.weight for layer in layers] + ([] if layers[0].bias is None else [layer.bias for layer in layers])
    device = x.device.type
    if torch.is_autocast_enabled(device):  # what autocast does to each F.linear: inputs cast, the matmul in dtype
        dtype = torch.get_autocast_dtype(device)
        x, params = x.to(dtype), [p.to(dtype) for p in params]
    with torch.autocast(device, enabled=False):
        out = _StackedLinear.apply(x, len(layers), *params)
    return out.split([layer.weight.shape[0] for layer in layers], dim=-1)


register("stacked_linear", "torch", name="torch:separate")(_separate)
register("stacked_linear", "npu", name="npu:one_matmul")(_stacked)


def stacks(x: torch.Tensor, layers: Sequence[object]) -> bool:
    """Whether `project(x, layers)` runs them as one stacked matmul: a backend that stacks, and `stackable`."""
    return has_own_kernel("stacked_linear", x.device) and stackable(x, layers)


def project(x: torch.Tensor, layers: Sequence[nn.Linear]) -> tuple[torch.Tensor, ...]:
    """`tuple(layer(x) for layer in layers)`, as one stacked matmul where `stacks` (counted as stacked_linear in
    report()["ran"] only then)."""
    if not stacks(x, layers):
        return _separate(x, layers)
    return run("stacked_linear", x.device)(x, layers)


def halves_of_one(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor | None:
    """The tensor whose last dimension is `first` then `second` side by side, when both are views of it that
    cover it exactly (project()'s outputs for two layers); None otherwise (and while torch.compile traces, where
    nothing is stacked)."""
    if torch.compiler.is_compiling():
        return None
    base = first._base
    if base is None or second._base is not base or first.shape[:-1] != base.shape[:-1]:
        return None
    if first.shape[-1] + second.shape[-1] != base.shape[-1] or not base.is_contiguous():
        return None
    if first.data_ptr() != base.data_ptr() or second.data_ptr() != base.data_ptr() + first.shape[-1] * \
            base.element_size() or first.stride() != base.stride() or second.stride() != base.stride():
        return None
    return base
