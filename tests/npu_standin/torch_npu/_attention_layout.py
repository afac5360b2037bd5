"""Layouts of npu_fusion_attention: shape parsing, varlen segments, and the move to and from [B, N, S, D] blocks.

Every layout is computed as a list of fp32 blocks [b, N, s, D]: one block for BSH/SBH/BSND/BNSD, one block per
varlen segment (b = 1) for TND. Outputs and softmax statistics are put back into the caller's layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _checks as C

LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
MAX_HEADS = 256
MAX_HEAD_DIM = 768
MAX_SEQ = 1024 * 1024
STAT_WIDTH = 8  # softmax_max / softmax_sum carry each row's value 8 times


@dataclass(frozen=True)
class Dims:
    layout: str
    batch: int  # B (TND: number of segments, filled in by segments())
    nq: int
    nkv: int
    sq: int  # TND: total query tokens T
    skv: int
    d: int
    dv: int


def parse_dims(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_num: int, layout: str) -> Dims:
    """Check q/k/v against the layout and head_num (= number of QUERY heads); return the problem's sizes."""
    C.check(layout in LAYOUTS, op, f"input_layout must be one of {LAYOUTS}, got {layout!r}", ValueError)
    C.check(1 <= head_num <= MAX_HEADS, op, f"head_num must be in 1..{MAX_HEADS}, got {head_num}")
    rank = 4 if layout in ("BSND", "BNSD") else 3
    for name, t in (("query", q), ("key", k), ("value", v)):
        C.check(t.dim() == rank, op, f"{name} must be {rank}-D for layout {layout}, got shape {tuple(t.shape)}")
    if layout in ("BSH", "SBH"):
        b_ax, s_ax = (0, 1) if layout == "BSH" else (1, 0)
        hq, hk, hv = q.shape[2], k.shape[2], v.shape[2]
        C.check(hq % head_num == 0, op, f"query hidden size {hq} is not a multiple of head_num {head_num}")
        d = hq // head_num
        C.check(hk % d == 0, op, f"key hidden size {hk} is not a multiple of the head dim {d}")
        nkv = hk // d
        C.check(nkv > 0 and hv % nkv == 0, op, f"value hidden size {hv} does not split into {nkv} kv heads")
        dv = hv // nkv
        batch, sq, skv = q.shape[b_ax], q.shape[s_ax], k.shape[s_ax]
        C.check(k.shape[b_ax] == batch and v.shape[b_ax] == batch, op, "query, key and value batch sizes differ")
        C.check(v.shape[s_ax] == skv, op, f"key and value sequence lengths differ ({skv} vs {v.shape[s_ax]})")
    else:
        n_ax = {"BSND": 2, "BNSD": 1, "TND": 1}[layout]
        nq, nkv = q.shape[n_ax], k.shape[n_ax]
        C.check(nq == head_num, op, f"head_num {head_num} must equal the number of query heads {nq} ({layout})")
        C.check(v.shape[n_ax] == nkv, op, f"key and value head counts differ ({nkv} vs {v.shape[n_ax]})")
        d, dv = q.shape[-1], v.shape[-1]
        C.check(k.shape[-1] == d, op, f"query and key head dims differ ({d} vs {k.shape[-1]})")
        if layout == "TND":
            batch, sq, skv = 0, q.shape[0], k.shape[0]
        else:
            s_ax = 1 if layout == "BSND" else 2
            batch, sq, skv = q.shape[0], q.shape[s_ax], k.shape[s_ax]
            C.check(k.shape[0] == batch and v.shape[0] == batch, op, "query, key and value batch sizes differ")
        C.check(v.shape[0 if layout == "TND" else s_ax] == skv, op, "key and value sequence lengths differ")
    C.check(nkv >= 1 and head_num % nkv == 0, op, f"query heads {head_num} must be a multiple of kv heads {nkv}")
    C.check(1 <= d <= MAX_HEAD_DIM, op, f"head dim {d} must be in 1..{MAX_HEAD_DIM}")
    C.check(1 <= dv <= d, op, f"value head dim {dv} must be in 1..{d} (Dq = Dk >= Dv)")
    C.check(1 <= sq <= MAX_SEQ and 1 <= skv <= MAX_SEQ, op, f"sequence lengths must be in 1..{MAX_SEQ}")
    return Dims(layout, batch, head_num, nkv, sq, skv, d, dv)


def _cumulative(op: str, name: str, value: object, total: int) -> list[int]:
    ends = C.int_list(op, name, value)
    C.check(len(ends) >= 1, op, f"{name} must not be empty")
    C.check(
        ends[0] != 0, op,
        f"{name} holds cumulative END offsets without a leading 0 (lengths 2,2,3 -> [2, 4, 7]), got {ends}",
    )
    C.check(
        all(b > a for a, b in zip([0] + ends, ends)), op, f"{name} must be strictly increasing and > 0, got {ends}"
    )
    C.check(ends[-1] == total, op, f"{name} must end at the token count T={total}, got last entry {ends[-1]}")
    return ends


def segments(op: str, dims: Dims, actual_seq_qlen, actual_seq_kvlen) -> list[tuple[int, int, int, int]]:
    """TND: [(q_start, q_end, kv_start, kv_end)] per segment; other layouts: []."""
    if dims.layout != "TND":
        C.check(
            actual_seq_qlen is None and actual_seq_kvlen is None, op,
            f"actual_seq_qlen/actual_seq_kvlen are only for input_layout='TND', not {dims.layout}",
            ValueError,
        )
        return []
    C.check(
        actual_seq_qlen is not None and actual_seq_kvlen is not None, op,
        "input_layout='TND' needs actual_seq_qlen and actual_seq_kvlen (host lists of cumulative end offsets)",
    )
    q_ends = _cumulative(op, "actual_seq_qlen", actual_seq_qlen, dims.sq)
    kv_ends = _cumulative(op, "actual_seq_kvlen", actual_seq_kvlen, dims.skv)
    C.check(len(q_ends) == len(kv_ends), op, "actual_seq_qlen and actual_seq_kvlen must have one length")
    return [(qs, qe, ks, ke) for qs, qe, ks, ke in zip([0] + q_ends, q_ends, [0] + kv_ends, kv_ends)]


def _to_bnsd(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        b, s, h = t.shape
        return t.reshape(b, s, heads, h // heads).transpose(1, 2)
    s, b, h = t.shape  # SBH
    return t.reshape(s, b, heads, h // heads).permute(1, 2, 0, 3)


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return t.contiguous()
    if layout == "BSND":
        return t.transpose(1, 2).contiguous()
    b, n, s, d = t.shape
    if layout == "BSH":
        return t.transpose(1, 2).reshape(b, s, n * d)
    return t.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


def split(t: torch.Tensor, dims: Dims, segs, heads: int, kv: bool = False) -> list[torch.Tensor]:
    """A q/k/v-like tensor of the caller's layout as fp32 [b, N, s, D] blocks."""
    t = t.float()
    if dims.layout != "TND":
        return [_to_bnsd(t, dims.layout, heads)]
    bounds = [(ks, ke) if kv else (qs, qe) for qs, qe, ks, ke in segs]
    return [t[a:b].permute(1, 0, 2).unsqueeze(0) for a, b in bounds]


def merge(blocks: list[torch.Tensor], dims: Dims) -> torch.Tensor:
    """[b, N, s, D] blocks back into the caller's layout (TND: [T, N, D])."""
    if dims.layout != "TND":
        return _from_bnsd(blocks[0], dims.layout)
    return torch.cat([blk.squeeze(0).permute(1, 0, 2) for blk in blocks], dim=0)


def split_stats(t: torch.Tensor, dims: Dims, segs) -> list[torch.Tensor]:
    """softmax_max/sum ([B, N, Sq, 8] or TND [T, N, 8]) as [b, N, s, 1] fp32 blocks."""
    if dims.layout != "TND":
        return [t[..., :1].float()]
    return [t[qs:qe, :, :1].float().permute(1, 0, 2).unsqueeze(0) for qs, qe, _, _ in segs]


def merge_stats(blocks: list[torch.Tensor], dims: Dims) -> torch.Tensor:
    if dims.layout != "TND":
        stat = blocks[0]
    else:
        stat = torch.cat([blk.squeeze(0).permute(1, 0, 2) for blk in blocks], dim=0)
    return stat.expand(*stat.shape[:-1], STAT_WIDTH).contiguous()


def stats_shape(dims: Dims) -> tuple[int, ...]:
    if dims.layout == "TND":
        return (dims.sq, dims.nq, STAT_WIDTH)
    return (dims.batch, dims.nq, dims.sq, STAT_WIDTH)


def out_shape(q: torch.Tensor, dims: Dims) -> tuple[int, ...]:
    """attention_out has q's layout with the value head dim."""
    if dims.layout in ("BSH", "SBH"):
        return (*q.shape[:2], dims.nq * dims.dv)
    return (*q.shape[:-1], dims.dv)
