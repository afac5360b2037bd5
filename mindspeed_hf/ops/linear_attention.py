"""The chunked gated delta rule of Gated DeltaNet layers (Qwen3-Next, Qwen3.5), one implementation per backend.

torch: transformers' own chunked implementation (the modeling module's `torch_chunk_gated_delta_rule`, passed in as
    `reference`: HF's numerics exactly, forward and backward through autograd).
cuda and npu: flash-linear-attention's `chunk_gated_delta_rule` when it is installed (its Triton kernels on CUDA;
    on Ascend it dispatches to its triton-ascend backend, which has a backward), else the torch one. torch_npu 2.14
    has no gated-delta-rule op. report() names which one runs.

Packed documents never reach these functions as one sequence: patches/linear_attention.py lays them out as rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .registry import register, run


@functools.cache
def fla_available() -> bool:
    """flash-linear-attention's chunked gated delta rule importable (it needs triton: CUDA, or triton-ascend)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception:  # ImportError, or triton failing to find a device
        return False
    return True


@register("linear_attention", "torch", name="torch:chunked (transformers)")
def chunk_rule_torch(reference: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor, **options) -> tuple[torch.Tensor, torch.Tensor | None]:
    return reference(query, key, value, g=g, beta=beta, **options)


def chunk_rule_fla(reference: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   g: torch.Tensor, beta: torch.Tensor, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                   output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                   **_: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T, H, D] in and out, as transformers' function; the key/query heads repeated up to the value heads
    (grouped value attention) as transformers does before its own kernel."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    groups = value.shape[2] // key.shape[2]
    if groups > 1:
        query, key = (x.repeat_interleave(groups, dim=2) for x in (query, key))
    out, state = chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                        output_final_state=output_final_state,
                                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return out.to(query.dtype), state


register("linear_attention", "cuda", name="fla:chunk_gated_delta_rule", available=fla_available)(chunk_rule_fla)
register("linear_attention", "npu", name="fla:chunk_gated_delta_rule (triton-ascend)",
         available=fla_available)(chunk_rule_fla)


def chunk_gated_delta_rule(reference: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           g: torch.Tensor, beta: torch.Tensor, **options) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over whole sequences with the backend for the tensors' device (counted)."""
    return run("linear_attention", query.device)(reference, query, key, value, g, beta, **options)
