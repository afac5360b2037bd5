"""npu_fusion_attention and npu_fusion_attention_grad: flash-attention reference math in fp32, per block.

softmax(scale * q.k^T masked) @ v with GQA (query head h reads kv head h // (Nq / Nkv)), optional dropout
(keep_prob < 1, mask regenerated from seed/offset), the 7-tuple output of the device op, and the explicit
flash-attention backward that the grad op computes from the forward's softmax_max/softmax_sum/attention_out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _attention_layout as L
from . import _attention_masks as M
from . import _checks as C

INNER_PRECISE = (0, 1, 2)
ROW_FIX = 2  # inner_precise=2 computes fully masked rows (as zeros); otherwise they are undefined on the device


@dataclass
class _Problem:
    dims: L.Dims
    segs: list
    q: list
    k: list
    v: list
    keeps: list
    scale: float
    keep_prob: float
    row_fix: bool
    numels: int


def _prepare(op, query, key, value, head_num, input_layout, *, scale_name, scale, pse, padding_mask, atten_mask,
             keep_prob, pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen,
             sparse_mode, softmax_layout, sink) -> _Problem:
    q = C.float_tensor(op, "query", query)
    k = C.float_tensor(op, "key", key)
    v = C.float_tensor(op, "value", value)
    C.same_dtype(op, query=q, key=k, value=v)
    C.same_device(op, query=q, key=k, value=v)
    head_num = C.integer(op, "head_num", head_num)
    layout = C.string(op, "input_layout", input_layout)
    scale = C.real(op, scale_name, scale)
    keep_prob = C.real(op, "keep_prob", keep_prob)
    C.check(0.0 < keep_prob <= 1.0, op, f"keep_prob must be in (0, 1], got {keep_prob}")
    inner_precise = C.integer(op, "inner_precise", inner_precise)
    C.check(inner_precise in INNER_PRECISE, op, f"inner_precise must be one of {INNER_PRECISE}, got {inner_precise}")
    if C.string(op, "softmax_layout", softmax_layout) != "":
        raise C.unsupported(op, f"softmax_layout={softmax_layout!r}")
    if pse is not None:
        raise C.unsupported(op, "pse (positional encoding bias)")
    if sink is not None:
        raise C.unsupported(op, "sink (attention sink logits)")
    if padding_mask is not None:
        raise RuntimeError(f"{op}: padding_mask is not supported by the device op; pass None (use atten_mask or TND)")
    dims = L.parse_dims(op, q, k, v, head_num, layout)
    segs = L.segments(op, dims, actual_seq_qlen, actual_seq_kvlen)
    if segs:
        lens = [(qe - qs, ke - ks) for qs, qe, ks, ke in segs]
        plan = M.plan(op, atten_mask, sparse_mode, pre_tockens, next_tockens, prefix, varlen=True, batch=len(segs),
                      heads=dims.nq, sq=max(a for a, _ in lens), skv=max(b for _, b in lens), seg_lens=lens)
        keeps = [M.segment_keep(plan, i, len(lens), a, b, q.device) for i, (a, b) in enumerate(lens)]
        numels = dims.nq * sum(a * b for a, b in lens)
    else:
        plan = M.plan(op, atten_mask, sparse_mode, pre_tockens, next_tockens, prefix, varlen=False,
                      batch=dims.batch, heads=dims.nq, sq=dims.sq, skv=dims.skv)
        keeps = [M.dense_keep(plan, dims.batch, dims.sq, dims.skv, q.device)]
        numels = dims.batch * dims.nq * dims.sq * dims.skv
    return _Problem(
        dims, segs, L.split(q, dims, segs, dims.nq), L.split(k, dims, segs, dims.nkv, kv=True),
        L.split(v, dims, segs, dims.nkv, kv=True), keeps, scale, keep_prob,
        inner_precise == ROW_FIX and layout != "TND", numels,
    )


def _dropout_keeps(prob: _Problem, seed: int, offset: int) -> list:
    """Per-block dropout keep masks [b, Nq, sq, skv], a pure function of (seed, offset) as on the device."""
    if prob.keep_prob >= 1.0:
        return [None] * len(prob.q)
    gen = torch.Generator(device="cpu")
    gen.manual_seed((seed * 1_000_003 + offset) % (2**63))
    shapes = [(q.shape[0], q.shape[1], q.shape[2], k.shape[2]) for q, k in zip(prob.q, prob.k)]
    return [(torch.rand(s, generator=gen) < prob.keep_prob).to(prob.q[0].device) for s in shapes]


def _empty_rows(op: str, keep, prob: _Problem):
    """Rows whose every key is masked: an error unless inner_precise=2 (non-TND) zeroes them."""
    if keep is None:
        return None
    empty = ~keep.any(dim=-1, keepdim=True)
    if not bool(empty.any()):
        return None
    if prob.dims.layout == "TND":
        raise RuntimeError(f"{op}: a query row is fully masked; TND does not allow fully masked rows")
    C.check(
        prob.row_fix, op,
        "a query row is fully masked: its output is undefined on the device unless inner_precise=2 "
        "(left padding? unpad to TND instead)",
    )
    return empty


def _expand_kv(t: torch.Tensor, nq: int) -> torch.Tensor:
    return t.repeat_interleave(nq // t.shape[1], dim=1)


def _forward_block(op, q, k, v, keep, drop, prob: _Problem):
    s = torch.matmul(q, _expand_kv(k, q.shape[1]).transpose(-1, -2)) * prob.scale
    empty = _empty_rows(op, keep, prob)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    if empty is not None:
        s = s.masked_fill(empty, 0.0)  # finite softmax there, zeroed below (no NaN in forward or backward)
    p = torch.softmax(s, dim=-1)
    with torch.no_grad():
        row_max = s.amax(dim=-1, keepdim=True)
        row_sum = torch.exp(s - row_max).sum(dim=-1, keepdim=True)
        if empty is not None:
            row_max = row_max.masked_fill(empty, float("-inf"))
            row_sum = row_sum.masked_fill(empty, 0.0)
    if empty is not None:
        p = p.masked_fill(empty, 0.0)
    if drop is not None:
        p = p * drop / prob.keep_prob
    return torch.matmul(p, _expand_kv(v, q.shape[1])), row_max, row_sum


def _group_sum(t: torch.Tensor, nkv: int) -> torch.Tensor:
    b, nq, s, d = t.shape
    return t.view(b, nkv, nq // nkv, s, d).sum(dim=2)


def _backward_block(op, q, k, v, dout, out, row_max, row_sum, keep, drop, prob: _Problem):
    nq, nkv = q.shape[1], k.shape[1]
    k_e, v_e = _expand_kv(k, nq), _expand_kv(v, nq)
    s = torch.matmul(q, k_e.transpose(-1, -2)) * prob.scale
    p = torch.exp(s - row_max) / row_sum
    empty = _empty_rows(op, keep, prob)
    if keep is not None:
        p = p.masked_fill(~keep, 0.0)
    if empty is not None:
        p = p.masked_fill(empty, 0.0)
    p_drop = p if drop is None else p * drop / prob.keep_prob
    dv = _group_sum(torch.matmul(p_drop.transpose(-1, -2), dout), nkv)
    dp = torch.matmul(dout, v_e.transpose(-1, -2))
    if drop is not None:
        dp = dp * drop / prob.keep_prob
    ds = p * (dp - (dout * out).sum(dim=-1, keepdim=True))
    dq = torch.matmul(ds, k_e) * prob.scale
    dk = _group_sum(torch.matmul(ds.transpose(-1, -2), q) * prob.scale, nkv)
    return dq, dk, dv


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1., keep_prob=1., pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False, softmax_layout="", sink=None, dropout_mask=None,
                         seed=0, offset=0):
    """Fused attention. Returns (attention_out in q's layout, softmax_max, softmax_sum, reserved empty tensor,
    seed, offset, numels); softmax_max/sum are fp32 [B, N, Sq, 8] (TND: [T, N, 8]).

    `scale` multiplies q.k^T and defaults to 1.0 (pass 1/sqrt(D) yourself); atten_mask is True = MASKED OUT.
    attention_out is differentiable w.r.t. query, key and value.
    """
    op = "npu_fusion_attention"
    if dropout_mask is not None:
        raise C.unsupported(op, "a precomputed dropout_mask")
    seed = C.integer(op, "seed", seed)
    offset = C.integer(op, "offset", offset)
    prob = _prepare(op, query, key, value, head_num, input_layout, scale_name="scale", scale=scale, pse=pse,
                    padding_mask=padding_mask, atten_mask=atten_mask, keep_prob=keep_prob,
                    pre_tockens=pre_tockens, next_tockens=next_tockens, inner_precise=inner_precise, prefix=prefix,
                    actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode,
                    softmax_layout=softmax_layout, sink=sink)
    if prob.keep_prob < 1.0 and seed == 0:
        seed = int(torch.randint(1, 2**31 - 1, ()))
    drops = _dropout_keeps(prob, seed, offset)
    outs, maxes, sums = [], [], []
    for q, k, v, keep, drop in zip(prob.q, prob.k, prob.v, prob.keeps, drops):
        out, row_max, row_sum = _forward_block(op, q, k, v, keep, drop, prob)
        outs.append(out)
        maxes.append(row_max)
        sums.append(row_sum)
    dims = prob.dims
    reserved = torch.empty(0, dtype=query.dtype, device=query.device)
    return (L.merge(outs, dims).to(query.dtype), L.merge_stats(maxes, dims), L.merge_stats(sums, dims), reserved,
            seed, offset, prob.numels)


def _check_saved(op: str, name: str, t, shape, dtype) -> torch.Tensor:
    C.check(t is not None, op, f"{name} from the forward is required")
    t = C.tensor(op, name, t)
    C.check(tuple(t.shape) == tuple(shape), op, f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    C.check(t.dtype == dtype, op, f"{name} must be {dtype}, got {t.dtype}")
    return t


def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                              atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                              attention_in=None, scale_value=1., keep_prob=1., pre_tockens=2147483647,
                              next_tockens=2147483647, inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
                              actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                              sync=False, softmax_layout="", sink=None):
    """(dq, dk, dv, dpse, dsink) of npu_fusion_attention, from the forward's softmax_max, softmax_sum and
    attention_out (attention_in). Note the keyword `scale_value`. dpse and dsink are empty tensors."""
    op = "npu_fusion_attention_grad"
    seed = C.integer(op, "seed", seed)
    offset = C.integer(op, "offset", offset)
    C.integer(op, "numels", numels)
    prob = _prepare(op, query, key, value, head_num, input_layout, scale_name="scale_value", scale=scale_value,
                    pse=pse, padding_mask=padding_mask, atten_mask=atten_mask, keep_prob=keep_prob,
                    pre_tockens=pre_tockens, next_tockens=next_tockens, inner_precise=inner_precise, prefix=prefix,
                    actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode,
                    softmax_layout=softmax_layout, sink=sink)
    dims = prob.dims
    out_shape = L.out_shape(query, dims)
    dy = _check_saved(op, "dy", dy, out_shape, query.dtype)
    attention_in = _check_saved(op, "attention_in", attention_in, out_shape, query.dtype)
    softmax_max = _check_saved(op, "softmax_max", softmax_max, L.stats_shape(dims), torch.float32)
    softmax_sum = _check_saved(op, "softmax_sum", softmax_sum, L.stats_shape(dims), torch.float32)
    C.check(prob.keep_prob >= 1.0 or seed != 0, op, "dropout (keep_prob < 1) needs the forward's seed and offset")
    drops = _dropout_keeps(prob, seed, offset)
    douts = L.split(dy, dims, prob.segs, dims.nq)
    outs = L.split(attention_in, dims, prob.segs, dims.nq)
    maxes = L.split_stats(softmax_max, dims, prob.segs)
    sums = L.split_stats(softmax_sum, dims, prob.segs)
    with torch.no_grad():  # a gradient kernel: its outputs carry no graph
        grads = [
            _backward_block(op, *blk, prob)
            for blk in zip(prob.q, prob.k, prob.v, douts, outs, maxes, sums, prob.keeps, drops)
        ]
        dq, dk, dv = (L.merge([g[i] for g in grads], dims).to(query.dtype) for i in range(3))
    empty = torch.empty(0, dtype=query.dtype, device=query.device)
    return dq, dk, dv, empty, empty.clone()
