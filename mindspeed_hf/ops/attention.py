"""Attention for HF models, registered as `attn_implementation="mindspeed"`.

HF calls `attention_forward(module, query [B,Nq,S,D], key/value [B,Nkv,S,D], attention_mask, ...)` and expects
`(attn_output [B,S,Nq,D], attn_weights)`. Before that, once per forward, it builds the mask with the function
registered under the same name in `AttentionMaskInterface`: a name missing there silently gets `attention_mask=None`,
so `mindspeed_mask` is registered too, and returns what the active backend consumes:

- torch / cuda: HF's SDPA mask, and attention is HF's own `sdpa_attention_forward` (same results as "sdpa"); on
  CPU an fp32 masked call of a GQA model shares the key/value heads in SDPA's kernel instead of repeating them.
- npu: a compact description instead of a [B,1,S,S] mask: None (plain causal), the 2-D padding mask, or HF's
  packed-sequence ids. `npu_fusion_attention` then runs BSND with the compressed 2048x2048 causal mask, or TND
  (padded / packed) with host cumulative lengths built once per step (see varlen.py). Whatever the op cannot do
  (softcap, output_attentions, bias or sinks, custom 4-D masks, head_dim > 768, more than 256 query heads, ...)
  runs the torch path on an equivalent SDPA mask, so results never change, only speed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from transformers import masking_utils
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from ..device import import_torch_npu
from ..releases import compat
from . import registry, varlen
from .registry import register, run, select

logger = logging.getLogger("mindspeed_hf")

ATTENTION_NAME = "mindspeed"

# npu_fusion_attention limits (torch_npu_ops.md).
_NPU_MAX_HEAD_DIM = 768
_NPU_MAX_HEADS = 256
_NPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_COMPRESSED_MASK_SIZE = 2048  # modes 2, 3, 4 take exactly this mask
CAUSAL_SPARSE_MODE = 3  # bottom-right causal; equal to 2 (top-left) here since Sq == Skv whenever we use it
_BAND_SPARSE_MODE = 4
_UNSUPPORTED_KWARGS = ("position_bias", "s_aux", "sinks")  # additive biases / attention sinks the op cannot take

_compressed_masks: dict[torch.device, torch.Tensor] = {}
_warned: set[str] = set()
# Packed-sequence id tensors handed out by mindspeed_mask, by identity: they are [B, S] integer tensors that a raw
# 0/1 padding mask could look like, so only these objects mean "packed". Strong references keep ids unique.
_packed_ids: OrderedDict[int, torch.Tensor] = OrderedDict()
_PACKED_KEEP = 8


def fall_back(reason: str, op: str = "attention") -> None:
    """This call of `op` runs the torch path because npu_fusion_attention cannot take it (`reason`): counted as a
    fallback (report()["fallbacks"]), and one warning per reason."""
    registry.fell_back(op)
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("mindspeed_hf: npu_fusion_attention cannot run %s; using the torch path there.", reason)


def _is_causal(module: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    # Same rule as HF's sdpa_attention_forward: the call's is_causal, else the module's flag, else causal.
    flag = kwargs.get("is_causal")
    return bool(flag if flag is not None else getattr(module, "is_causal", True))


def _is_packed_ids(mask: torch.Tensor | None) -> bool:
    return mask is not None and _packed_ids.get(id(mask)) is mask


# ---------------------------------------------------------------------------------------------------- torch path


def _eager(module, query, key, value, mask, dropout, scaling, softcap, is_causal):
    """Plain matmul-softmax attention (what HF's eager does), for softcap and output_attentions that SDPA lacks."""
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    q_len, kv_len = query.shape[2], key.shape[2]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None and is_causal and q_len > 1:
        # What SDPA's is_causal means (top-left aligned): HF only leaves the mask out when that is right.
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()
    if mask is not None:
        if mask.dtype == torch.bool:
            # Additive, as HF's eager mask: the gradient then matches HF's eager in fully masked rows too.
            mask = torch.where(mask, 0.0, torch.finfo(scores.dtype).min).to(scores.dtype)
        scores = scores + mask[..., :kv_len]
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=getattr(module, "training", True))
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


def _shares_kv_heads(module, query, key, mask, dropout, kwargs) -> bool:
    """An fp32 CPU call with key/value heads shared by several query heads under a 4-D boolean mask of the keys'
    length (a padded or packed batch), nothing else (no bias, no explicit causal flag, no dropout: its random mask
    would be drawn by another kernel than HF's): SDPA can share the heads in its kernel (enable_gqa). HF repeats them
    first here (it shares them only without a mask, for CUDA's sake: masked GQA leaves CUDA's fused kernels), which
    on CPU costs two copies forward and two sums backward per layer. In fp32 sharing changes only the last bits of
    dK / dV (the group sum's order); in bf16 / fp16 HF rounds each repeated head's gradient before summing, a
    difference training would show, so there HF's path runs."""
    return (isinstance(mask, torch.Tensor) and query.is_cpu and query.dtype == torch.float32 and not dropout
            and getattr(module, "num_key_value_groups", 1) > 1
            and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[-1] == key.shape[-2]
            and kwargs.get("position_bias") is None and kwargs.get("is_causal") is not True
            and query.shape[1] == key.shape[1] * module.num_key_value_groups)


def _reference(module, query, key, value, mask, dropout, scaling, softcap, kwargs):
    """HF's SDPA attention on an SDPA-style mask (4-D bool/float or None); eager where SDPA cannot. On CPU an fp32
    masked GQA call shares the key/value heads in SDPA's kernel (HF's outputs; gradients within fp32 rounding)."""
    if softcap is not None or kwargs.get("output_attentions"):
        return _eager(module, query, key, value, mask, dropout, scaling, softcap, _is_causal(module, kwargs))
    if _shares_kv_heads(module, query, key, mask, dropout, kwargs):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                               scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def _expand_compact_mask(mask, query, key, sliding_window, is_causal):
    """The SDPA mask (4-D bool or None) equal to a compact npu mask: None, 2-D padding, or packed ids."""
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    window = sliding_window if is_causal and sliding_window is not None and sliding_window < kv_len else None
    if mask is None and window is None:
        return None  # plain causal or full attention: SDPA's is_causal rule gives it
    if is_causal:
        fn = masking_utils.causal_mask_function
        if window is not None:
            fn = masking_utils.sliding_window_causal_mask_function(window)
    else:
        fn = compat.bidirectional_mask_function
    padding = None
    if _is_packed_ids(mask):
        fn = masking_utils.and_masks(fn, masking_utils.packed_sequence_mask_function(mask))
    elif mask is not None:
        padding = mask.to(device=query.device, dtype=torch.bool)
    return masking_utils.sdpa_mask(
        batch_size=batch, kv_length=kv_len, kv_offset=0, mask_function=fn, attention_mask=padding,
        local_size=window, allow_is_causal_skip=mask is None,
        **compat.mask_query_kwargs(q_len, kv_len - q_len, query.device),
    )


@register("attention", "torch", name="torch:sdpa")
def attention_torch(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                    softcap=None, **kwargs):
    """Exactly HF's "sdpa" attention (eager math only for softcap / output_attentions, which SDPA refuses)."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        # A compact mask from the npu mask builder (the backend changed in between): expand it.
        attention_mask = _expand_compact_mask(attention_mask, query, key, sliding_window, _is_causal(module, kwargs))
    return _reference(module, query, key, value, attention_mask, dropout, scaling, softcap, kwargs)


# On CUDA, torch's SDPA already dispatches to flash / memory-efficient / cuDNN kernels.
register("attention", "cuda", name="cuda:sdpa", available=lambda: True)(attention_torch)


# ------------------------------------------------------------------------------------------------------ npu path


def compressed_causal_mask(device: torch.device) -> torch.Tensor:
    """The 2048x2048 mask sparse modes 2/3/4 require (True = masked), built once per device."""
    mask = _compressed_masks.get(device)
    if mask is None:
        size = _COMPRESSED_MASK_SIZE
        with torch.inference_mode(False):  # cached for later training steps: never an inference tensor
            mask = torch.triu(torch.ones(size, size, dtype=torch.bool, device=device), diagonal=1)
        _compressed_masks[device] = mask
    return mask


def _npu_unsupported(query, key, value, mask, softcap, kwargs) -> str | None:
    """Why npu_fusion_attention cannot compute this call exactly, or None when it can."""
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if softcap is not None:
        return "softcap (attention logit soft-capping)"
    if kwargs.get("output_attentions"):
        return "output_attentions (it returns no attention weights)"
    if any(kwargs.get(name) is not None for name in _UNSUPPORTED_KWARGS):
        return "attention biases or sinks"
    if mask is not None and mask.dim() != 2:
        if q_len != kv_len:
            return "a materialised 4-D mask with queries shorter than keys (cached decoding)"
        return "a materialised 4-D mask that is not block-diagonal causal (a custom pattern or an additive bias)"
    if query.dtype not in _NPU_DTYPES or not (query.dtype == key.dtype == value.dtype):
        return "these dtypes (q, k, v must share fp16, bf16 or fp32)"
    if dim > _NPU_MAX_HEAD_DIM or key.shape[-1] != dim or value.shape[-1] > dim:
        return f"head_dim > {_NPU_MAX_HEAD_DIM} or unequal q/k head dims"
    if heads > _NPU_MAX_HEADS or heads % kv_heads:
        return f"more than {_NPU_MAX_HEADS} query heads, or query heads not a multiple of key/value heads"
    if q_len != kv_len and (q_len > 1 or mask is not None):
        return "queries shorter than keys (cached decoding)"
    if mask is not None and tuple(mask.shape) != (batch, kv_len):
        return "a 2-D mask not shaped [batch, kv_length]"
    return None


def _npu_call(query, key, value, layout, heads, scale, keep_prob, causal, window, cu_seqlens=None):
    kw: dict[str, Any] = {"scale": float(scale), "keep_prob": float(keep_prob)}
    if causal:
        kw["atten_mask"] = compressed_causal_mask(query.device)
        if window is not None:
            # HF's sliding window keeps keys with q_idx - kv_idx < window; the band keeps
            # q_idx - pre_tockens <= kv_idx <= q_idx + next_tockens, so pre_tockens = window - 1.
            kw.update(sparse_mode=_BAND_SPARSE_MODE, pre_tockens=int(window) - 1, next_tockens=0)
        else:
            kw["sparse_mode"] = CAUSAL_SPARSE_MODE
    if cu_seqlens is not None:
        kw.update(actual_seq_qlen=cu_seqlens, actual_seq_kvlen=cu_seqlens)
    return import_torch_npu().npu_fusion_attention(query, key, value, heads, layout, **kw)[0]


def _varlen_for(mask, kwargs) -> varlen.VarlenInfo:
    """The TND description of this batch, computed once per step (cached on the describing tensor)."""
    if not _is_packed_ids(mask):
        return varlen.varlen_info(mask, "padding")
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if isinstance(cu_q, torch.Tensor):
        # DataCollatorWithFlattening already sends the boundaries: read them instead of recomputing them (the
        # comparison with cu_seq_lens_k is on host tuples, both cached: no device sync per layer).
        info = varlen.varlen_info(cu_q, "cu_seqlens")
        same_k = cu_k is None or cu_k is cu_q or (
            isinstance(cu_k, torch.Tensor) and varlen.varlen_info(cu_k, "cu_seqlens") == info)
        if same_k and info.total == mask.numel():
            return info
    return varlen.varlen_info(mask, "sequence_ids")


def _block_causal(mask, query, key) -> varlen.VarlenInfo | None:
    """The documents of a materialised block-diagonal causal 4-D mask over this call's [B, S] (varlen.block_causal)."""
    return varlen.block_causal(mask, query.shape[0], query.shape[2], key.shape[2])


@register("attention", "npu", name="npu:npu_fusion_attention")
def attention_npu(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                  softcap=None, **kwargs):
    """npu_fusion_attention: BSND + compressed causal mask, or TND for padded / packed batches (packed: HF's
    sequence ids, the collator's cu_seq_lens, or a block-diagonal causal 4-D mask)."""
    mask = attention_mask
    is_causal = _is_causal(module, kwargs)
    blocks = _block_causal(mask, query, key)
    if blocks is not None:
        # The mask is the whole pattern (SDPA applies no causal flag or window beside a mask): causal documents.
        mask, is_causal, sliding_window = None, True, None
    reason = _npu_unsupported(query, key, value, mask, softcap, kwargs)
    info = blocks
    if reason is None and mask is not None:
        info = _varlen_for(mask, kwargs)
    if reason is None and info is not None:
        if info.is_dense(query.shape[0]):
            # One whole sequence per row, e.g. the sequence ids that transformers 4.57 hands over for every batch
            # without an attention mask (compat.unpacked_batches_get_sequence_ids()): the plain dense call below.
            info = None
        elif sliding_window is not None and sliding_window < query.shape[2] and not info.contiguous:
            reason = "a sliding window over padding with holes"
    if reason is not None:
        fall_back(reason)
        if blocks is not None:  # the caller's own 4-D mask, as given
            mask = attention_mask
        elif mask is None or mask.dim() == 2:  # compact (ours): the SDPA mask it stands for
            mask = _expand_compact_mask(mask, query, key, sliding_window, is_causal)
        return _reference(module, query, key, value, mask, dropout, scaling, softcap, kwargs)

    batch, heads, q_len, dim = query.shape
    scale = scaling if scaling is not None else dim**-0.5  # the op's default scale is 1.0, not 1/sqrt(D)
    keep_prob = 1.0 - dropout
    causal = is_causal and q_len > 1  # a single query sees every key, as in SDPA
    window = sliding_window if causal and sliding_window is not None and sliding_window < q_len else None

    if info is None:  # no padding, no packing: one dense BSND call, K/V heads shared natively (GQA)
        q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
        return _npu_call(q, k, v, "BSND", heads, scale, keep_prob, causal, window), None

    # Padded or packed: TND, every sequence its own (padding in place as sequences no real token sees, or only
    # the real tokens end to end when a row has holes), so no row is ever fully masked (left padding works).
    if info.num_tokens == 0:
        return query.new_zeros(batch, q_len, heads, value.shape[-1]), None
    q, k, v = (varlen.unpad(t, info) for t in (query, key, value))
    out = _npu_call(q, k, v, "TND", heads, scale, keep_prob, causal, window, cu_seqlens=info.cu_seqlens)
    return varlen.pad(out, info, batch, q_len), None


# --------------------------------------------------------------------------------------------- public entries


def _remember_packed(ids: torch.Tensor) -> torch.Tensor:
    """Register `ids` as packed-sequence ids (what _is_packed_ids recognises), the newest few kept."""
    _packed_ids[id(ids)] = ids
    while len(_packed_ids) > _PACKED_KEEP:
        _packed_ids.popitem(last=False)
    return ids


def _packed_from_boundaries(module, query, key, attention_mask, kwargs) -> torch.Tensor | None:
    """HF's packed-sequence ids for a causal batch whose documents are told only by the collator's `cu_seq_lens_q`
    (no position ids, or a plain causal mask: what flash attention reads, where HF's mask code sees no packing), so
    every backend keeps the documents apart (varlen.boundary_ids); None otherwise."""
    cu_q = kwargs.get("cu_seq_lens_q")
    if not isinstance(cu_q, torch.Tensor) or not _is_causal(module, kwargs) or query.shape[2] != key.shape[2]:
        return None
    if attention_mask is not None:  # transformers 4.57 materialises a plain causal mask where 5.x leaves it out
        info = _block_causal(attention_mask, query, key)
        if info is None or not info.is_dense(query.shape[0]):
            return None
    ids = varlen.boundary_ids(cu_q, kwargs.get("cu_seq_lens_k"), query.shape[0], query.shape[2], query.device)
    return None if ids is None else _remember_packed(ids)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HF AttentionInterface function: q [B,Nq,S,D], k/v [B,Nkv,S,D] -> ([B,S,Nq,D], weights or None)."""
    packed = _packed_from_boundaries(module, query, key, attention_mask, kwargs)
    attention_mask = attention_mask if packed is None else packed
    return run("attention", query.device)(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
        sliding_window=sliding_window, softcap=softcap, **kwargs,
    )


@dataclass(frozen=True)
class _Pattern:
    causal: bool
    packed_ids: torch.Tensor | None


def _closure(fn) -> dict[str, Any]:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    return dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code is not None else {}


def _scan(fn, found: dict[str, Any]) -> bool:
    """Walk HF's mask-function combinators; False on anything we cannot express with the fused op."""
    if fn is masking_utils.causal_mask_function:
        found["causal"] = True
        return True
    if getattr(fn, "__module__", None) != masking_utils.__name__:
        return False
    name, cells = fn.__qualname__, _closure(fn)
    if name == "and_masks.<locals>.and_mask":
        return all(_scan(f, found) for f in cells.get("mask_functions", (None,)))
    if name == "sliding_window_overlay.<locals>.inner_mask":
        return True  # the window itself reaches attention as its `sliding_window` argument (as for FA2)
    if name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        # Positions rise by one inside a packed sequence, so causality on positions = causality on indices.
        return "mask_function" in cells and _scan(cells["mask_function"], found)
    if name == "packed_sequence_mask_function.<locals>.inner_mask":
        found["packed"] = cells.get("packed_sequence_mask")
        return isinstance(found["packed"], torch.Tensor)
    return False


def _recognise(mask_function) -> _Pattern | None:
    found: dict[str, Any] = {}
    if not _scan(mask_function, found) or not found.get("causal"):
        return None
    return _Pattern(True, found.get("packed"))


def mindspeed_mask(
    batch_size: int,
    kv_length: int,
    kv_offset: int = 0,
    mask_function=masking_utils.causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """HF AttentionMaskInterface function: the mask `attention_forward` wants for the active backend.

    torch / cuda: HF's sdpa_mask. npu: for a causal (optionally sliding, optionally packed) pattern without cache
    offsets, None / the 2-D padding mask (as for flash attention) / HF's packed-sequence ids; anything else gets
    the SDPA mask, which the attention runs on the torch path. The queries arrive as the installed release
    describes them (`q_length`/`q_offset` or `cache_position`, see compat.mask_query_span) and are passed on as is.
    """
    args = dict(batch_size=batch_size, kv_length=kv_length, kv_offset=kv_offset, mask_function=mask_function,
                attention_mask=attention_mask, **kwargs)
    q_length, q_offset, device = compat.mask_query_span(kwargs, kv_length)
    device = device or (attention_mask.device if attention_mask is not None else "cpu")
    if select("attention", device).backend != "npu":
        return masking_utils.sdpa_mask(**args)
    pattern = _recognise(mask_function)
    plain = (
        pattern is not None
        and isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == kv_offset == 0
        and q_length == kv_length
        and (attention_mask is None or tuple(attention_mask.shape) == (batch_size, kv_length))
    )
    if not plain or (pattern.packed_ids is None and kwargs.get("allow_is_causal_skip") is False):
        # Cache offsets, custom patterns, or a model that asked for a materialised mask (it combines it with
        # something else): the SDPA mask, run on the torch path. (Packing also turns the skip off in HF, so
        # only an unpacked batch can tell that request apart.)
        return masking_utils.sdpa_mask(**args)
    if pattern.packed_ids is not None:
        return _remember_packed(pattern.packed_ids)
    return masking_utils.flash_attention_mask(**args)


_MISSING = object()
# (interface class, name) -> what was registered under that name before us
_previous: dict[tuple[type, str], Any] = {}
#: Attention implementations registered by us: name -> (attention function, mask function, what it is, for report()).
#: ATTENTION_NAME is registered by enable(); higher floors add theirs (context parallelism's ring / Ulysses).
OUR_ATTENTIONS: dict[str, tuple[Any, Any, str]] = {}


def register_attention(name: str = ATTENTION_NAME, forward: Any = None, mask: Any = None,
                       note: str = "our attention kernel") -> None:
    """Register an attention function and its mask function with transformers under `name` (default: ours,
    attention_forward and mindspeed_mask, under "mindspeed"). Idempotent; unregister_attention() undoes every
    registration exactly."""
    forward, mask = (forward, mask) if name != ATTENTION_NAME else (attention_forward, mindspeed_mask)
    OUR_ATTENTIONS[name] = (forward, mask, note)
    for interface, fn in ((AttentionInterface, forward), (AttentionMaskInterface, mask)):
        current = compat.registered(interface).get(name, _MISSING)
        if current is fn:
            continue
        _previous.setdefault((interface, name), current)
        interface.register(name, fn)


def unregister_attention() -> None:
    """Undo every register_attention exactly: restore what was there before, or remove the entries."""
    for name, (forward, mask, _) in list(OUR_ATTENTIONS.items()):
        for interface, fn in ((AttentionInterface, forward), (AttentionMaskInterface, mask)):
            previous = _previous.pop((interface, name), _MISSING)
            mapping = compat.registered(interface)
            if mapping.get(name, _MISSING) is not fn:
                continue  # replaced by someone else since: leave it
            if previous is _MISSING:
                del mapping[name]
            else:
                mapping[name] = previous
        del OUR_ATTENTIONS[name]
