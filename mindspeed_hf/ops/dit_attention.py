"""Attention for diffusers' denoisers (self, cross and joint text+image attention): full (non-causal) attention of
q [B, Sq, N, D] over k / v [B, Skv, N, D] ("BSND", diffusers' dispatcher layout) or [B, N, S, D] ("BNSD", what
attention_processor.py's processors hand to F.scaled_dot_product_attention), with an optional SDPA-style mask
(bool: True = attend; float: added to the scores).

- torch / cuda: torch's scaled_dot_product_attention, exactly what diffusers' "native" backend runs (on CUDA it
  dispatches to flash / memory-efficient / cuDNN kernels itself).
- npu: ONE npu_fusion_attention call per attention layer, in the layout the tensors already have (a BNSD view of
  BSND memory is passed as BSND, no copy). A key-padding mask ([B, 1, 1, Skv], Qwen-Image's and HunyuanVideo's text
  mask) becomes the op's drop mask (True = masked out) broadcast to [B, 1, Sq, Skv] while that is small; past
  DENSE_MASK_ELEMENTS (a video's tokens squared) the queries attend the kept keys in TND layout instead (host
  lengths computed once per mask tensor). 4-D bool masks ([B, 1|N, Sq, Skv]) are passed inverted. Additive float
  masks, causal attention and GQA run the torch path (one warning per reason): results never change, only speed.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import torch
import torch.nn.functional as F

from ..device import import_torch_npu
from .attention import fall_back
from .registry import register, run

_NPU_MAX_HEAD_DIM = 768
_NPU_MAX_HEADS = 256
_NPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Above this many mask elements (B x Sq x Skv) a key-padding mask runs as TND over the kept keys instead of a
#: materialised [B, 1, Sq, Skv] drop mask (64 Mi bools: a 4k-token image batch fits, a 75k-token video does not).
DENSE_MASK_ELEMENTS = 1 << 26
_KEPT_CACHE = 8
_kept: OrderedDict[tuple[int, int], tuple[torch.Tensor, tuple[torch.Tensor, tuple[int, ...]]]] = OrderedDict()


def _bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.permute(0, 2, 1, 3) if layout == "BSND" else t


@register("dit_attention", "torch", name="torch:sdpa")
def dit_attention_torch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: str,
                        attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, scale: float | None = None,
                        is_causal: bool = False) -> torch.Tensor:
    """torch's SDPA on [B, N, S, D] views; the output in the input layout (diffusers' native backend)."""
    out = F.scaled_dot_product_attention(_bnsd(query, layout), _bnsd(key, layout), _bnsd(value, layout),
                                         attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    return _bnsd(out, layout)


register("dit_attention", "cuda", name="cuda:sdpa", available=lambda: True)(dit_attention_torch)


def _key_padding(mask: torch.Tensor, batch: int, kv_len: int) -> torch.Tensor | None:
    """The [B, Skv] keep mask when `mask` only masks keys (shape [B|1, 1, 1, Skv]), else None."""
    if mask.dim() == 4 and mask.shape[1] == mask.shape[2] == 1 and mask.shape[3] == kv_len:
        return mask.reshape(mask.shape[0], kv_len).expand(batch, kv_len)
    return None


def _npu_unsupported(query, key, value, layout, mask, is_causal) -> str | None:
    n_ax = 2 if layout == "BSND" else 1
    heads, dim = query.shape[n_ax], query.shape[-1]
    if is_causal:
        return "causal diffusion attention"
    if mask is not None and mask.dtype != torch.bool:
        return "an additive (float) attention mask"
    if mask is not None and mask.dim() != 4:
        return "a mask that is not 4-D"
    if query.dtype not in _NPU_DTYPES or not (query.dtype == key.dtype == value.dtype):
        return "these dtypes (q, k, v must share fp16, bf16 or fp32)"
    if dim > _NPU_MAX_HEAD_DIM or key.shape[-1] != dim or value.shape[-1] > dim:
        return f"head_dim > {_NPU_MAX_HEAD_DIM} or unequal q/k head dims"
    if heads > _NPU_MAX_HEADS or key.shape[n_ax] != heads:
        return f"more than {_NPU_MAX_HEADS} heads, or fewer key/value heads than query heads"
    return None


def _kept_keys(mask: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(flat indices of the kept keys, host cumulative kept counts per row) of `keep`, the [B, Skv] keep mask of
    the model's `mask`: one host read per mask tensor (a model passes one mask object to every block), cached by
    the identity and version of `mask`."""
    key = (id(mask), mask._version)
    hit = _kept.get(key)
    if hit is not None and hit[0] is mask:
        return hit[1]
    counts = keep.sum(1).tolist()
    info = (keep.reshape(-1).nonzero().reshape(-1), tuple(itertools.accumulate(int(c) for c in counts)))
    _kept[key] = (mask, info)
    while len(_kept) > _KEPT_CACHE:
        _kept.popitem(last=False)
    return info


def _call(query, key, value, heads, layout, scale, keep_prob, **kw) -> torch.Tensor:
    return import_torch_npu().npu_fusion_attention(query, key, value, heads, layout, scale=float(scale),
                                                   keep_prob=float(keep_prob), **kw)[0]


@register("dit_attention", "npu", name="npu:npu_fusion_attention")
def dit_attention_npu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: str,
                      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, scale: float | None = None,
                      is_causal: bool = False) -> torch.Tensor:
    """One npu_fusion_attention call (see the module docstring)."""
    reason = _npu_unsupported(query, key, value, layout, attn_mask, is_causal)
    if reason is not None:
        fall_back(reason, "dit_attention")
        return dit_attention_torch(query, key, value, layout, attn_mask, dropout_p, scale, is_causal)
    out_layout = layout
    if layout == "BNSD" and all(t.transpose(1, 2).is_contiguous() for t in (query, key, value)):
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))  # BSND memory seen as BNSD: no copy
        layout = "BSND"
    query, key, value = (t.contiguous() for t in (query, key, value))
    s_ax = 1 if layout == "BSND" else 2
    batch, heads, q_len, kv_len = query.shape[0], query.shape[3 - s_ax], query.shape[s_ax], key.shape[s_ax]
    scale = scale if scale is not None else query.shape[-1] ** -0.5  # the op's default scale is 1.0
    keep_prob = 1.0 - dropout_p
    drop = None
    if attn_mask is not None:
        keep = _key_padding(attn_mask, batch, kv_len)
        if keep is not None and batch * q_len * kv_len > DENSE_MASK_ELEMENTS:
            index, kv_ends = _kept_keys(attn_mask, keep)
            if all(b > a for a, b in zip((0, *kv_ends), kv_ends)):  # a row with no key left: SDPA's NaN row
                out = _kept_keys_call(query, key, value, layout, index, kv_ends, heads, scale, keep_prob)
                return out if out_layout == layout else out.transpose(1, 2)
        drop = (~attn_mask).expand(batch, attn_mask.shape[1], q_len, kv_len).contiguous()
    out = _call(query, key, value, heads, layout, scale, keep_prob, atten_mask=drop)
    return out if out_layout == layout else out.transpose(1, 2)


def _kept_keys_call(query, key, value, layout, index, kv_ends, heads, scale, keep_prob) -> torch.Tensor:
    """Every query over its row's kept keys: TND, the queries of each row one segment, the kept keys another."""
    if layout == "BNSD":
        query, key, value = (t.transpose(1, 2).contiguous() for t in (query, key, value))
    batch, q_len = query.shape[:2]
    q = query.reshape(batch * q_len, *query.shape[2:])
    k, v = (t.reshape(-1, *t.shape[2:]).index_select(0, index) for t in (key, value))
    q_ends = tuple(q_len * (row + 1) for row in range(batch))
    out = _call(q, k, v, heads, "TND", scale, keep_prob, actual_seq_qlen=q_ends, actual_seq_kvlen=kv_ends)
    out = out.reshape(batch, q_len, *out.shape[1:])
    return out if layout == "BSND" else out.transpose(1, 2)


def dit_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: str,
                  attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, scale: float | None = None,
                  is_causal: bool = False) -> torch.Tensor:
    """Full attention of a denoiser layer with the backend for the tensors' device; output in `layout`
    ("BSND": [B, S, N, D], "BNSD": [B, N, S, D])."""
    return run("dit_attention", query.device)(query, key, value, layout, attn_mask, dropout_p, scale, is_causal)


def clear_cache() -> None:
    """Forget the cached kept-key indices (tests)."""
    _kept.clear()
