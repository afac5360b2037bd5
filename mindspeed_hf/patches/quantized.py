"""Quantized base layers (QLoRA): what runs for bitsandbytes' 4-bit linears, and what FSDP2 can shard.

Nothing here replaces bitsandbytes' layers. Our kernels run around them (norms, rotary, attention and SwiGLU call
the `Linear4bit` / PEFT `lora.Linear4bit` submodules, never their raw weights) and the fused loss calls a quantized
lm_head as a module (ops/fused_linear_cross_entropy). bitsandbytes itself picks the NF4 kernel from the weight's
device through torch's dispatcher: its own for cpu / cuda / xpu / hpu / mps, else the "default" pure-torch kernels
(registered for CompositeExplicitAutograd), which is what an Ascend NPU gets: bitsandbytes ships no npu backend, and
torch_npu has no NF4 op (its weight-quantized matmuls, `npu_weight_quant_batchmatmul` and the antiquant arguments of
`npu_grouped_matmul`, take affine int8 / int4 weights, `scale * (w + offset)`, which NF4's 16-entry codebook is not).

FSDP2 shards a Linear4bit's packed weight like any parameter (bitsandbytes restores its quant state from the module
after the all-gather). The packed bytes must never be cast: FSDP2 leaves a uint8 storage alone, but casts a
floating-point `bnb_4bit_quant_storage` to a different mixed-precision `param_dtype`, which `check_fsdp` refuses.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

_OP = "bitsandbytes::dequantize_4bit"


def _bnb_classes() -> tuple[type, type] | None:
    """(Linear4bit, Linear8bitLt) when bitsandbytes is already imported (a model that holds its layers imported
    it); None otherwise, so that asking never imports it."""
    if "bitsandbytes" not in sys.modules:
        return None
    import bitsandbytes as bnb

    return bnb.nn.Linear4bit, bnb.nn.Linear8bitLt


def quantized_linears(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The bitsandbytes 4-bit and 8-bit linear layers of `model` (PEFT's wrappers hold them as `base_layer`)."""
    classes = _bnb_classes()
    if classes is None:
        return [], []
    four, eight = classes
    modules = list(model.modules())
    return [m for m in modules if isinstance(m, four)], [m for m in modules if isinstance(m, eight)]


def _dispatch_key(device_type: str) -> str | None:
    try:
        return torch._C._dispatch_key_for_device(device_type)
    except RuntimeError:  # a device type torch does not know here (npu without torch_npu)
        return None


def kernel_for(device: torch.device | str) -> str:
    """Which bitsandbytes NF4 dequantize kernel runs for weights on `device` (read from torch's dispatcher)."""
    device_type = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    key = _dispatch_key(device_type)
    if key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(_OP, key):
        return f"bitsandbytes:{device_type}"
    if torch._C._dispatch_has_kernel_for_dispatch_key(_OP, "CompositeExplicitAutograd"):
        note = "; torch_npu has no NF4 kernel" if device_type == "npu" else ""
        return f"bitsandbytes:default (pure-torch dequantize + matmul{note})"
    return "none (bitsandbytes has no 4-bit kernel here)"


def _quant_state(layer: nn.Module) -> Any:
    return getattr(layer.weight, "quant_state", None) or getattr(layer, "quant_state", None)


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def describe(model: nn.Module, device: torch.device | str) -> dict[str, Any] | None:
    """report()'s "quantized_linear": how many bitsandbytes linears `model` has, their format and the kernel that
    runs them on `device`; None when it has none."""
    four, eight = quantized_linears(model)
    if not four and not eight:
        return None
    out: dict[str, Any] = {"modules": len(four) + len(eight)}
    if four:
        states = [_quant_state(m) for m in four]
        out.update(
            quant_type=sorted({s.quant_type for s in states if s is not None}),
            double_quant=any(getattr(s, "nested", False) for s in states),
            quant_storage=sorted({_dtype_name(getattr(m, "quant_storage", None)) for m in four} - {None}),
            compute_dtype=sorted({_dtype_name(m.compute_dtype) for m in four} - {None}),
            implementation=kernel_for(device),
        )
    if eight:
        out["int8_modules"] = len(eight)
    return out


def check_fsdp(model: nn.Module, param_dtype: torch.dtype | None) -> None:
    """Refuse, before anything is sharded, the quantized layers FSDP2 cannot carry: 8-bit layers (their int8
    weight's CB / SCB state lives on the parameter and is lost when it is sharded) and a floating-point 4-bit
    storage that mixed precision would cast (it holds packed 4-bit codes, not numbers)."""
    four, eight = quantized_linears(model)
    if eight:
        raise ValueError(
            "FSDP2 cannot shard bitsandbytes 8-bit layers (load_in_8bit / Linear8bitLt: their quantization state, "
            "CB / SCB, lives on the weight and is lost when it is sharded); load the model with "
            "BitsAndBytesConfig(load_in_4bit=True) for QLoRA under FSDP2, or train without FSDP "
            "(parallel.dp_shard / --fsdp)")
    if param_dtype is None:
        return
    storages = {m.weight.dtype for m in four if m.weight.dtype.is_floating_point and m.weight.dtype != param_dtype}
    if storages:
        found = ", ".join(sorted(str(s) for s in storages))
        raise ValueError(
            f"FSDP2 mixed precision (param_dtype={param_dtype}) would cast the packed 4-bit weights stored as "
            f"{found} (BitsAndBytesConfig bnb_4bit_quant_storage); load with bnb_4bit_quant_storage=torch.uint8 "
            f"or {param_dtype}, or train without bf16/fp16 mixed precision")
