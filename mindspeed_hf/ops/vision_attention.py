"""Vision-tower attention over the packed patches of ALL images at once (Qwen2-VL / Qwen2.5-VL / Qwen3-VL).

HF's vision attention gets q/k/v for every patch of every image laid end to end and `cu_seqlens` (cumulative patch
counts per image, or per window in Qwen2.5-VL's window blocks, with a leading 0). With any attention name that lacks
"flash" it splits them by `cu_seqlens` and runs one attention call per image (per window) from a Python loop. This op
takes the whole set in one go:

- npu: ONE `npu_fusion_attention` call in TND layout with `actual_seq_qlen = actual_seq_kvlen = cu_seqlens[1:]` (a
  host tuple, read once per step and shared by every layer through varlen's cache), no mask (full attention inside
  each image / window).
- torch / cuda: the segments grouped by length, one SDPA call per distinct length on the stacked [n, N, L, D]
  segments (a single call when all windows have one size): the same per-segment attention as HF's loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..device import import_torch_npu
from . import varlen
from .attention import fall_back
from .registry import register, run

_NPU_MAX_HEAD_DIM = 768
_NPU_MAX_HEADS = 256
_NPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def segment_ends(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """Host tuple of cumulative end offsets (no leading 0, empty segments dropped), cached per tensor."""
    return varlen.varlen_info(cu_seqlens, "cu_seqlens").cu_seqlens


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout: float) -> torch.Tensor:
    """[n, L, N, D] segments -> [n, L, N, D], full (non-causal) attention inside each segment."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         dropout_p=dropout, is_causal=False, scale=scale)
    return out.transpose(1, 2)


@register("vision_attention", "torch", name="torch:sdpa_by_length")
def vision_attention_torch(q, k, v, cu_seqlens, scale, dropout=0.0):
    """One SDPA call per distinct segment length over the stacked segments of that length."""
    ends = segment_ends(cu_seqlens)
    lengths = [end - start for start, end in zip((0, *ends), ends)]
    if len(set(lengths)) == 1:  # every image / window of one size: a plain reshape, one call
        n, length = len(lengths), lengths[0]
        shape = (n, length, *q.shape[1:])
        return _sdpa(q.reshape(shape), k.reshape(shape), v.reshape(shape), scale, dropout).reshape(q.shape)
    pieces = [t.split(lengths) for t in (q, k, v)]
    outs: list[torch.Tensor | None] = [None] * len(lengths)
    for length in dict.fromkeys(lengths):
        idx = [i for i, n in enumerate(lengths) if n == length]
        # a lone segment is a view; several of one length are stacked into one batch
        stacked = (p[idx[0]].unsqueeze(0) if len(idx) == 1 else torch.stack([p[i] for i in idx]) for p in pieces)
        for i, out in zip(idx, _sdpa(*stacked, scale, dropout).unbind(0)):
            outs[i] = out
    return torch.cat(outs)


register("vision_attention", "cuda", name="cuda:sdpa_by_length", available=lambda: True)(vision_attention_torch)


def _npu_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    if q.dtype not in _NPU_DTYPES or not (q.dtype == k.dtype == v.dtype):
        return "these dtypes (q, k, v must share fp16, bf16 or fp32)"
    if q.shape[-1] > _NPU_MAX_HEAD_DIM or q.shape[1] > _NPU_MAX_HEADS:
        return f"vision heads with head_dim > {_NPU_MAX_HEAD_DIM} or more than {_NPU_MAX_HEADS} heads"
    return None


@register("vision_attention", "npu", name="npu:npu_fusion_attention(TND)")
def vision_attention_npu(q, k, v, cu_seqlens, scale, dropout=0.0):
    """One TND npu_fusion_attention call over every image (or window) of the batch."""
    reason = _npu_unsupported(q, k, v)
    if reason is not None:
        fall_back(reason, "vision_attention")
        return vision_attention_torch(q, k, v, cu_seqlens, scale, dropout)
    ends = segment_ends(cu_seqlens)
    q, k, v = (t.contiguous() for t in (q, k, v))
    return import_torch_npu().npu_fusion_attention(
        q, k, v, q.shape[1], "TND", scale=float(scale), keep_prob=1.0 - float(dropout),
        actual_seq_qlen=ends, actual_seq_kvlen=ends,
    )[0]


def vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                     dropout: float = 0.0) -> torch.Tensor:
    """Full attention inside each segment of the packed patches: q/k/v [S, N, D] (TND), `cu_seqlens` the segments'
    cumulative lengths with a leading 0 (HF's vision `cu_seqlens`). Returns [S, N, D]."""
    return run("vision_attention", q.device)(q, k, v, cu_seqlens, scale, dropout)
