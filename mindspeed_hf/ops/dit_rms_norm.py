"""RMSNorm modules of diffusers' denoisers: torch.nn.RMSNorm (Flux, Flux.2 and Wan's q/k norms, Wan's across all
heads) and diffusers' own `normalization.RMSNorm` (Qwen-Image, HunyuanVideo, SD3.5 q/k norms).

- torch / cuda: the module's own forward (torch's rms_norm, or diffusers' formula with its casting rules).
- npu: npu_rms_norm on the output dtype the module's forward gives (torch.nn.RMSNorm: the input's; diffusers': the
  weight's when it is half precision, else the input promoted with fp32), with the weight cast to it (the op wants
  one dtype), plus diffusers' optional bias. A module without a weight, or normalising over more than the last
  dim, runs its own forward. In fp32 the results are equal; in bf16 the op multiplies the weight in fp32 before
  the cast (last-bit differences, as with transformers' RMSNorm kernel).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..device import import_torch_npu
from .registry import register, run

_HALF = (torch.float16, torch.bfloat16)


@register("dit_rms_norm", "torch", name="torch")
def dit_rms_norm_torch(module: nn.Module, x: torch.Tensor, original: Callable) -> torch.Tensor:
    return original(module, x)


def _out_dtype(module: nn.Module, x: torch.Tensor) -> torch.dtype:
    if isinstance(module, nn.RMSNorm):
        return x.dtype
    weight = module.weight.dtype
    return weight if weight in _HALF else torch.promote_types(x.dtype, torch.float32)


def _eps(module: nn.Module, dtype: torch.dtype) -> float:
    eps = module.eps
    return torch.finfo(dtype).eps if eps is None else float(eps)  # torch.nn.RMSNorm(eps=None): the dtype's


@register("dit_rms_norm", "npu", name="npu:npu_rms_norm")
def dit_rms_norm_npu(module: nn.Module, x: torch.Tensor, original: Callable) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    if weight is None or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        return original(module, x)
    dtype = _out_dtype(module, x)
    y = import_torch_npu().npu_rms_norm(x.to(dtype), weight.to(dtype), epsilon=_eps(module, x.dtype))[0]
    bias = getattr(module, "bias", None)
    return y if bias is None else y + bias


def dit_rms_norm(module: nn.Module, x: torch.Tensor, original: Callable) -> torch.Tensor:
    """`module`'s RMSNorm of `x` with the backend for x's device (`original`: the class's own forward)."""
    return run("dit_rms_norm", x.device)(module, x, original)
