"""RMSNorm: y = x / rms(x) * w, or * (1 + w) in the offset form (Gemma).

The torch reference follows HF's casting exactly: the plain form normalises in fp32, casts back to the input
dtype, then multiplies by the weight; the offset form multiplies in fp32 and casts last.
"""

from __future__ import annotations

import torch

from ..device import import_torch_npu
from .registry import register, run


@register("rms_norm", "torch", name="torch")
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (1.0 + weight.float())).to(input_dtype)
    return weight * normed.to(input_dtype)


@register("rms_norm", "npu", name="npu:npu_rms_norm")
def rms_norm_npu(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    # The op wants gamma in the input dtype; it multiplies in fp32 internally (last-bit bf16 drift vs HF).
    gamma = (1.0 + weight.float()) if offset else weight
    return import_torch_npu().npu_rms_norm(x, gamma.to(x.dtype), epsilon=eps)[0]


@register("rms_norm", "cuda", name="cuda:liger_rms_norm")
def rms_norm_liger(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    casting = "gemma" if offset else "llama"
    return LigerRMSNormFunction.apply(x, weight, eps, 1.0 if offset else 0.0, casting, False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """RMSNorm of `x` over its last dim with the backend for `x`'s device. `offset=True` scales by (1 + weight)."""
    return run("rms_norm", x.device)(x, weight, eps, offset)
