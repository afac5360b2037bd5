"""One block of attention with its log-sum-exp, and its backward: the per-device kernels the ring runs.

Layout everywhere: q [B, Nq, Sq, D], k / v [B, Nkv, Sk, D(v)] (HF's attention layout), Nq a multiple of Nkv (GQA).
`block_forward` returns (out [B, Nq, Sq, Dv] in q's dtype, lse [B, Nq, Sq] fp32); a row that sees no key has
lse = -inf and out = 0, so that it drops out of the log-sum-exp merge. `block_backward` takes the FINAL (merged)
out and lse of the rows and returns this block's share of (dq, dk, dv): p = exp(s - lse) is then the global
softmax restricted to the block, which is what flash-attention backward kernels compute from saved statistics.

`causal` means top-left causal on a square block (the ring only asks for it on the diagonal); `keep` is an
optional bool mask broadcastable to [B, 1, Sq, Sk], True = attend (packed documents).

Backends (ops.registry, per the tensors' device or MINDSPEED_HF_BACKEND):
- torch: CPU tensors run `aten._scaled_dot_product_flash_attention_for_cpu` (+ `_backward`), which returns the
  logsumexp and takes GQA natively (measured on torch 2.13: fp32 within 6e-7 of the matmul-softmax math, block
  backward with final statistics exact); other devices run the exact matmul-softmax math below.
- cuda: `aten._scaled_dot_product_flash_attention` (+ `_backward`) for fp16 / bf16 without a mask, the exact math
  otherwise. Written against the torch 2.13 schemas but NOT run here (no GPU on the development machine).
- npu: `npu_fusion_attention` (BNSD) whose softmax_max / softmax_sum give lse = max + log(sum), and
  `npu_fusion_attention_grad` fed softmax_max = lse, softmax_sum = 1 (so exp(s - max) / sum = exp(s - lse)).
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import repeat_kv

from ...device import import_torch_npu
from ...ops.attention import CAUSAL_SPARSE_MODE, compressed_causal_mask
from ...ops.registry import register, run, select

FORWARD_OP = "context_block_forward"
BACKWARD_OP = "context_block_backward"
_STAT_WIDTH = 8  # npu_fusion_attention's softmax_max / softmax_sum repeat each row's value 8 times
_FULL_MASK_MODE = 1  # npu sparse_mode 1: atten_mask used as given
_ROW_FIX = 2  # npu inner_precise 2: rows without any key are computed (as zeros), not left undefined


def _causal_keep(sq: int, sk: int, device) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()


def _full_keep(q, k, causal: bool, keep: torch.Tensor | None) -> torch.Tensor | None:
    """The bool keep pattern (broadcastable to [B, 1, Sq, Sk]) that `causal` and `keep` describe together."""
    if causal:
        tri = _causal_keep(q.shape[2], k.shape[2], q.device)
        return tri if keep is None else keep & tri
    return keep


def _empty_rows(keep: torch.Tensor | None) -> torch.Tensor | None:
    """[B, 1 or N, Sq] True where a row has no key at all, or None when every row has one."""
    if keep is None:
        return None
    empty = ~keep.any(dim=-1)
    return empty if bool(empty.any()) else None


def _expand_kv(t: torch.Tensor, nq: int) -> torch.Tensor:
    return repeat_kv(t, nq // t.shape[1])


def _group_sum(t: torch.Tensor, nkv: int) -> torch.Tensor:
    b, nq, s, d = t.shape
    return t.view(b, nkv, nq // nkv, s, d).sum(dim=2)


# ------------------------------------------------------------------------------------- exact math (any device)


def _scores(q, k, scale, keep):
    s = torch.matmul(q.float(), _expand_kv(k, q.shape[1]).float().transpose(-1, -2)) * scale
    return s if keep is None else s.masked_fill(~keep, float("-inf"))


def math_forward(q, k, v, *, causal: bool, scale: float, keep: torch.Tensor | None = None):
    """Exact fp32 matmul-softmax block attention with its log-sum-exp (the reference every kernel matches)."""
    keep = _full_keep(q, k, causal, keep)
    s = _scores(q, k, scale, keep)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # rows without keys: -inf - -inf
    out = torch.matmul(p, _expand_kv(v, q.shape[1]).float())
    return out.to(q.dtype), lse


def math_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float, keep: torch.Tensor | None = None):
    """Exact fp32 gradient of one block given the final out / lse of its rows."""
    nq, nkv = q.shape[1], k.shape[1]
    keep = _full_keep(q, k, causal, keep)
    k_e, v_e = _expand_kv(k, nq).float(), _expand_kv(v, nq).float()
    p = torch.exp(_scores(q, k, scale, keep) - lse.unsqueeze(-1)).nan_to_num(0.0)
    dout32 = dout.float()
    dv = _group_sum(torch.matmul(p.transpose(-1, -2), dout32), nkv)
    dp = torch.matmul(dout32, v_e.transpose(-1, -2))
    ds = p * (dp - (dout32 * out.float()).sum(dim=-1, keepdim=True))
    dq = torch.matmul(ds, k_e) * scale
    dk = _group_sum(torch.matmul(ds.transpose(-1, -2), q.float()) * scale, nkv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ------------------------------------------------------------------------------------------------------ torch/cpu


def _additive(keep: torch.Tensor | None, dtype) -> torch.Tensor | None:
    if keep is None:
        return None
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, float("-inf"))


def _cpu_mask(q, k, causal: bool, keep: torch.Tensor | None):
    """(is_causal, additive mask) for the CPU kernel: its own causal flag without a mask (no S x S tensor)."""
    if keep is None:
        return causal, None
    return False, _additive(_full_keep(q, k, causal, keep), q.dtype)


@register(FORWARD_OP, "torch", name="torch:flash_attention_for_cpu")
def torch_forward(q, k, v, *, causal: bool, scale: float, keep: torch.Tensor | None = None):
    """CPU: the fused flash kernel with logsumexp; elsewhere: the exact math."""
    if q.device.type != "cpu":
        return math_forward(q, k, v, causal=causal, scale=scale, keep=keep)
    is_causal, mask = _cpu_mask(q, k, causal, keep)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
    empty = None if keep is None else _empty_rows(_full_keep(q, k, causal, keep))
    if empty is not None:  # the kernel reports lse = 0 for rows without keys: make them drop out of the merge
        lse = lse.masked_fill(empty, float("-inf"))
    return out, lse


@register(BACKWARD_OP, "torch", name="torch:flash_attention_for_cpu_backward")
def torch_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float, keep: torch.Tensor | None = None):
    if q.device.type != "cpu":
        return math_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, keep=keep)
    is_causal, mask = _cpu_mask(q, k, causal, keep)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale)


# ----------------------------------------------------------------------------------------------------------- cuda


def _cuda_flash_fits(q, k, keep) -> bool:
    return keep is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0


def _cuda_available() -> bool:
    return torch.cuda.is_available()


@register(FORWARD_OP, "cuda", name="cuda:sdpa_flash_lse", available=_cuda_available)
def cuda_forward(q, k, v, *, causal: bool, scale: float, keep: torch.Tensor | None = None):
    """SDPA's flash kernel (which returns the logsumexp) for fp16/bf16 without a mask; exact math otherwise.
    Untested here: written against the torch 2.13 schema, run only where a GPU is present."""
    if not _cuda_flash_fits(q, k, keep):
        return math_forward(q, k, v, causal=causal, scale=scale, keep=keep)
    nq = q.shape[1]
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        q.contiguous(), _expand_kv(k, nq).contiguous(), _expand_kv(v, nq).contiguous(), 0.0, causal, False,
        scale=scale)
    return res[0], res[1].float()


@register(BACKWARD_OP, "cuda", name="cuda:sdpa_flash_lse_backward", available=_cuda_available)
def cuda_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float, keep: torch.Tensor | None = None):
    if not _cuda_flash_fits(q, k, keep):
        return math_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, keep=keep)
    nq, nkv = q.shape[1], k.shape[1]
    empty = torch.empty(0, dtype=torch.int32, device=q.device)
    rng = torch.empty(0, dtype=torch.int64, device=q.device)  # dropout is off: the philox state is not read
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q.contiguous(), _expand_kv(k, nq).contiguous(), _expand_kv(v, nq).contiguous(),
        out.contiguous(), lse.contiguous(), empty, empty, q.shape[2], k.shape[2], 0.0, causal, rng, rng, scale=scale)
    return dq, _group_sum(dk, nkv), _group_sum(dv, nkv)


# ------------------------------------------------------------------------------------------------------------ npu


def _npu_mask_kwargs(q, k, causal: bool, keep: torch.Tensor | None) -> dict:
    if keep is not None:
        full = _full_keep(q, k, causal, keep)
        return {"atten_mask": ~full, "sparse_mode": _FULL_MASK_MODE, "inner_precise": _ROW_FIX}
    if causal:
        return {"atten_mask": compressed_causal_mask(q.device), "sparse_mode": CAUSAL_SPARSE_MODE}
    return {}


def _npu_keep(q, k, keep):
    # The op takes [B,1,Sq,Sk] or [Sq,Sk] masks only: materialise broadcast dims.
    if keep is None:
        return None
    if keep.dim() == 2:
        return keep
    return keep.expand(keep.shape[0], 1, q.shape[2], k.shape[2])


@register(FORWARD_OP, "npu", name="npu:npu_fusion_attention_lse")
def npu_forward(q, k, v, *, causal: bool, scale: float, keep: torch.Tensor | None = None):
    """npu_fusion_attention BNSD (GQA native); lse from its softmax_max / softmax_sum outputs."""
    keep = _npu_keep(q, k, keep)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # ring pieces are sequence slices (strided)
    res = import_torch_npu().npu_fusion_attention(
        q, k, v, q.shape[1], "BNSD", scale=float(scale), keep_prob=1.0, **_npu_mask_kwargs(q, k, causal, keep))
    out, row_max, row_sum = res[0], res[1][..., 0], res[2][..., 0]
    return out, row_max + torch.log(row_sum)


@register(BACKWARD_OP, "npu", name="npu:npu_fusion_attention_grad")
def npu_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float, keep: torch.Tensor | None = None):
    keep = _npu_keep(q, k, keep)
    stat = lse.unsqueeze(-1).expand(*lse.shape, _STAT_WIDTH).contiguous()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    res = import_torch_npu().npu_fusion_attention_grad(
        q, k, v, dout.contiguous(), q.shape[1], "BNSD", softmax_max=stat, softmax_sum=torch.ones_like(stat),
        attention_in=out.contiguous(), scale_value=float(scale), keep_prob=1.0, **_npu_mask_kwargs(q, k, causal, keep))
    return res[0], res[1], res[2]


# -------------------------------------------------------------------------------------------------------- entries


def block_forward(q, k, v, *, causal: bool, scale: float, keep: torch.Tensor | None = None):
    """(out [B,Nq,Sq,Dv] in q's dtype, lse [B,Nq,Sq] fp32) of one block on the selected backend."""
    return run(FORWARD_OP, q.device)(q, k, v, causal=causal, scale=scale, keep=keep)


def block_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float, keep: torch.Tensor | None = None):
    """(dq, dk, dv) of one block from the final out / lse of its rows, on the selected backend."""
    return select(BACKWARD_OP, q.device).fn(dout, q, k, v, out, lse, causal=causal, scale=scale, keep=keep)
