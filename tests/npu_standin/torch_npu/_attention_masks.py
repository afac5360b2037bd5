"""atten_mask and sparse_mode of npu_fusion_attention: validation, and the KEEP pattern (True = attend) per block.

On the device atten_mask is bool/uint8 with TRUE MEANING MASKED OUT. sparse_mode:
  0 the full mask, restricted to the band pre_tockens/next_tockens counted from the top-left diagonal
  1 the full mask as is;  2 top-left causal;  3 bottom-right causal
  4 band from the bottom-right diagonal;  5 prefix with a full BNSS/B1SS mask;  6 prefix, compressed 3072x2048 mask
  7 (TND) bottom-right causal, the LAST segment a band;  8 (TND) top-left causal, the FIRST segment a band
Modes 2, 3, 4, 7, 8 take the compressed mask torch.triu(torch.ones(2048, 2048), diagonal=1).bool().
atten_mask=None means full attention whatever sparse_mode says.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from . import _checks as C

COMPRESSED = 2048
COMPRESSED_MODES = (2, 3, 4, 7, 8)
PREFIX_SHAPE = (3072, 2048)
NO_LIMIT = 2147483647
_VALIDATED: list = []  # (weakref, _version, kind) of compressed masks already compared with their pattern


@functools.cache
def _reference(kind: str) -> torch.Tensor:
    causal = torch.triu(torch.ones(COMPRESSED, COMPRESSED), diagonal=1).bool()
    if kind == "causal":
        return causal
    rect = torch.zeros(PREFIX_SHAPE[0] - COMPRESSED, COMPRESSED, dtype=torch.bool)
    rect[:, COMPRESSED // 2:] = True
    return torch.cat([causal, rect], dim=0)


@dataclass(frozen=True)
class MaskPlan:
    mode: int
    mask: torch.Tensor | None  # bool, True = masked out; None = full attention
    pre: int
    nxt: int
    prefix: list[int] | None


def band(sq: int, skv: int, pre: int, nxt: int, bottom_right: bool, device) -> torch.Tensor:
    """Keep (i, j) with -pre <= j - i - diag <= nxt; diag = 0 (top-left origin) or skv - sq (bottom-right)."""
    rel = torch.arange(skv, device=device)[None, :] - torch.arange(sq, device=device)[:, None]
    if bottom_right:
        rel = rel - (skv - sq)
    return (rel <= nxt) & (rel >= -pre)


def _check_band(op: str, mode: int, pre: int, nxt: int, sq: int, skv: int) -> None:
    if mode == 0:
        if nxt < 0:
            C.check(pre >= -nxt and -nxt < skv, op, f"next_tockens={nxt} < 0 needs pre_tockens >= {-nxt}, |next| < Skv")
        if pre < 0:
            C.check(nxt >= -pre and -pre < sq, op, f"pre_tockens={pre} < 0 needs next_tockens >= {-pre}, |pre| < Sq")
    elif mode == 4:
        C.check(pre + nxt >= 0, op, f"sparse_mode 4 band is empty (pre_tockens={pre}, next_tockens={nxt})")


def _check_full_shape(op: str, mask: torch.Tensor, mode: int, varlen: bool, batch, heads, sq, skv) -> None:
    shape = tuple(mask.shape)
    if varlen:
        C.check(
            len(shape) == 2 and shape[0] >= sq and shape[1] >= skv, op,
            f"unsupported atten_mask shape {list(shape)}: TND takes only [Sq, Skv] with Sq >= {sq}, Skv >= {skv}",
        )
        return
    allowed = [(batch, heads, sq, skv), (batch, 1, sq, skv)]
    if mode != 5:
        allowed += [(1, 1, sq, skv), (sq, skv)]
    if shape not in allowed and len(shape) == 4 and shape[2] == 1 and sq != 1:
        raise RuntimeError(
            f"{op}: unsupported atten_mask shape {list(shape)}: a [B,1,1,S] padding mask is rejected; "
            f"expand it to [B,1,Sq,Skv] (True = masked out) or unpad to TND"
        )
    C.check(
        shape in allowed, op,
        f"unsupported atten_mask shape {list(shape)} for sparse_mode {mode}: allowed {[list(s) for s in allowed]}",
    )


def _check_exact(op: str, mask: torch.Tensor, mode: int, kind: str) -> None:
    if any(ref() is mask and mask._version == version and k == kind for ref, version, k in _VALIDATED):
        return  # the same unchanged tensor (callers cache it): skip the 4M-element comparison
    ref = _reference(kind)
    C.check(
        tuple(mask.shape) == tuple(ref.shape), op,
        f"sparse_mode {mode} needs the compressed {list(ref.shape)} mask "
        f"(torch.triu(torch.ones(2048, 2048), diagonal=1).bool(){' + prefix rows' if kind == 'prefix' else ''}), "
        f"got shape {list(mask.shape)}",
    )
    C.check(
        torch.equal(mask.cpu() if mask.dtype == torch.bool else mask.cpu() != 0, ref), op,
        f"sparse_mode {mode} atten_mask must be exactly the compressed upper-triangular pattern "
        "torch.triu(ones, diagonal=1) with True = masked out (a tril/inverted mask is wrong polarity)",
    )
    _VALIDATED[:] = [*_VALIDATED[-7:], (weakref.ref(mask), mask._version, kind)]


def plan(op, atten_mask, sparse_mode, pre, nxt, prefix, *, varlen, batch, heads, sq, skv, seg_lens=()) -> MaskPlan:
    """Validate the mask arguments. For TND pass sq/skv as the longest segment and seg_lens [(sq_i, skv_i)]."""
    mode = C.integer(op, "sparse_mode", sparse_mode)
    pre = C.integer(op, "pre_tockens", pre)
    nxt = C.integer(op, "next_tockens", nxt)
    C.check(0 <= mode <= 8, op, f"sparse_mode must be in 0..8, got {mode}")
    C.check(varlen or mode not in (7, 8), op, f"sparse_mode {mode} is only for input_layout='TND'")
    C.check(not varlen or mode != 5, op, "sparse_mode 5 is not supported with input_layout='TND'")
    if mode not in (5, 6):
        C.check(prefix is None, op, f"prefix is only used by sparse_mode 5/6, not {mode}", ValueError)
    if atten_mask is None:
        return MaskPlan(mode, None, pre, nxt, None)
    mask = C.tensor(op, "atten_mask", atten_mask)
    C.check(
        mask.dtype in (torch.bool, torch.uint8), op,
        f"atten_mask must be bool or uint8 with True = masked out, got {mask.dtype}",
    )
    if mode in COMPRESSED_MODES:
        _check_exact(op, mask, mode, "causal")
    elif mode == 6:
        _check_exact(op, mask, mode, "prefix")
    else:
        _check_full_shape(op, mask, mode, varlen, batch, heads, sq, skv)
        mask = mask if mask.dtype == torch.bool else mask != 0
    if mode in (0, 4):
        _check_band(op, mode, pre, nxt, sq, skv)
    if mode in (7, 8) and seg_lens:
        last = seg_lens[-1] if mode == 7 else seg_lens[0]
        C.check(pre >= last[1], op, f"sparse_mode {mode}: pre_tockens must be >= the band segment's Skv {last[1]}")
        if mode == 7:
            C.check(last[0] - last[1] <= nxt <= 0, op, "sparse_mode 7: need last_Sq - last_Skv <= next_tockens <= 0")
            C.check(all(a <= b for a, b in seg_lens[:-1]), op, "sparse_mode 7: causal segments need Sq <= Skv")
        else:
            C.check(nxt >= last[0] - last[1], op, "sparse_mode 8: need next_tockens >= first_Sq - first_Skv")
    prefix_list = None
    if mode in (5, 6):
        C.check(prefix is not None, op, f"sparse_mode {mode} needs prefix (one int per batch)")
        prefix_list = C.int_list(op, "prefix", prefix)
        C.check(len(prefix_list) == batch, op, f"prefix must have {batch} entries, got {len(prefix_list)}")
        C.check(all(0 <= n <= skv for n in prefix_list), op, f"prefix entries must be in 0..{skv}: {prefix_list}")
    return MaskPlan(mode, mask, pre, nxt, prefix_list)


def _keep(p: MaskPlan, sq: int, skv: int, device, index: int, count: int) -> torch.Tensor:
    """Keep pattern [sq, skv] of the pattern-only modes for batch / segment `index` of `count`."""
    is_band = p.mode == 4 or (p.mode == 7 and index == count - 1) or (p.mode == 8 and index == 0)
    if is_band:
        return band(sq, skv, p.pre, p.nxt, True, device)
    if p.mode in (2, 8):
        return band(sq, skv, NO_LIMIT, 0, False, device)  # top-left causal
    causal_br = band(sq, skv, NO_LIMIT, 0, True, device)  # modes 3, 6, 7
    if p.mode == 6:
        return causal_br | (torch.arange(skv, device=device) < p.prefix[index])[None, :]
    return causal_br


def dense_keep(p: MaskPlan, batch: int, sq: int, skv: int, device) -> torch.Tensor | None:
    """Keep mask for one BSH/SBH/BSND/BNSD call, broadcastable to [B, N, Sq, Skv]; None = keep all."""
    if p.mask is None:
        return None
    if p.mode in (0, 1, 5):
        keep = ~p.mask.to(device)
        keep = keep.view(1, 1, sq, skv) if keep.dim() == 2 else keep
        if p.mode == 0:
            keep = keep & band(sq, skv, p.pre, p.nxt, False, device)
        return keep
    if p.mode != 6:  # the same pattern for every batch
        return _keep(p, sq, skv, device, 0, batch).view(1, 1, sq, skv)
    return torch.stack([_keep(p, sq, skv, device, b, batch) for b in range(batch)]).unsqueeze(1)


def segment_keep(p: MaskPlan, index: int, count: int, sq: int, skv: int, device) -> torch.Tensor | None:
    """Keep mask [1, 1, sq, skv] for TND segment `index` of `count`; None = keep all."""
    if p.mask is None:
        return None
    if p.mode in (0, 1):
        keep = ~p.mask[:sq, :skv].to(device)
        if p.mode == 0:
            keep = keep & band(sq, skv, p.pre, p.nxt, False, device)
    else:
        keep = _keep(p, sq, skv, device, index, count)
    return keep.view(1, 1, sq, skv)
