"""Ring attention over a process group: K/V travel around the ring, partial results merge by log-sum-exp.

Each rank holds its slice of the sequence (q [B, Nq, S_local, D], k / v [B, Nkv, S_local, D], HF's layout; Nq a
multiple of Nkv for GQA) in one of two layouts (split.py makes them):
- contiguous: rank r holds tokens [r * S_local, (r + 1) * S_local);
- zigzag: the sequence is cut into 2 * cp chunks and rank r holds chunks r and 2 * cp - 1 - r, which gives every
  rank the same causal work.
At ring step i rank r computes its queries against the K/V of rank (r - i) mod cp while the next K/V is already on
its way (batched isend/irecv to the next rank). Under causal attention a step is one or two "pieces" (a query
range against a key range), each entirely visible or square-causal (the diagonal), and blocks entirely in the
future are skipped:
    contiguous: source == r -> causal; source < r -> full; source > r -> nothing;
    zigzag:     source == r -> causal over both local chunks (they are in order); source < r -> all queries
                against the source's first chunk; source > r -> the second query chunk against both source chunks.
Partial outputs merge in fp32 with the running log-sum-exp (online softmax). Backward runs the ring again: each
block's dq adds up locally, and each block's dk / dv (fp32) travel with that K/V and arrive home after the last
step; every block's gradient uses the final out and lse of its rows (blocks.py).

Packed documents: `segment_ids` (local [B, S_local] ints, equal = same document, from split.segment_ids) restrict
each piece to keys of the same document (documents may cross rank boundaries: causality comes from the pieces,
document boundaries from the ids); a sliding window (HF's q_pos - k_pos < window) comes from the global
`position_ids`. Both become a per-piece bool mask (every rank's ids are all-gathered once per call, small integer
tensors); pieces where nothing is visible are skipped, rows without a visible key drop out of the merge (lse -inf).
No dropout: attention dropout must be 0 under context parallelism.
`local_attention` is the same autograd function without a ring (one rank): the device kernel and its backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .blocks import block_backward, block_forward

_ALL = slice(None)


@dataclass(frozen=True)
class Piece:
    """One block of a ring step: queries `q` (a slice of the local sequence) against keys `kv` of the source."""

    q: slice
    kv: slice
    causal: bool


def step_pieces(rank: int, source: int, local_len: int, causal: bool, zigzag: bool) -> list[Piece]:
    """The blocks rank `rank` computes against the K/V that rank `source` holds (see the module docstring)."""
    if not causal:
        return [Piece(_ALL, _ALL, False)]
    if source == rank:
        return [Piece(_ALL, _ALL, True)]
    if not zigzag:
        return [Piece(_ALL, _ALL, False)] if source < rank else []
    half = local_len // 2
    if source < rank:
        return [Piece(_ALL, slice(0, half), False)]
    return [Piece(slice(half, local_len), _ALL, False)]


class _Ring:
    """Batched point-to-point exchange with the ring neighbours: send to rank + 1, receive from rank - 1."""

    def __init__(self, group, tag_base: int = 0) -> None:
        self.group, self.tag_base = group, tag_base  # rings in flight together use distinct tags
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)
        self._reqs: list = []
        self._recv: list[torch.Tensor] = []

    def start(self, tensors: list[torch.Tensor]) -> None:
        self._recv = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        ops = []
        for tag, (out, inp) in enumerate(zip(tensors, self._recv), start=self.tag_base):
            ops.append(dist.P2POp(dist.isend, out.contiguous(), self.next, self.group, tag))
            ops.append(dist.P2POp(dist.irecv, inp, self.prev, self.group, tag))
        self._reqs = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for req in self._reqs:
            req.wait()
        self._reqs = []
        return self._recv


def merge_into(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """Online-softmax merge in place (fp32): out, lse <- the attention over both key sets. -inf lse = no keys."""
    new = torch.logaddexp(lse, blk_lse)
    old_w = torch.exp(lse - new).nan_to_num(0.0).unsqueeze(-1)
    blk_w = torch.exp(blk_lse - new).nan_to_num(0.0).unsqueeze(-1)
    out.mul_(old_w).add_(blk_out.float() * blk_w)
    lse.copy_(new)


@dataclass(frozen=True)
class _Setup:
    group: object  # None: no ring (one rank, the local kernel with its autograd)
    rank: int
    world: int
    causal: bool
    scale: float
    zigzag: bool
    segments: list[torch.Tensor] | None  # every rank's local segment ids, by ring rank
    positions: list[torch.Tensor] | None  # every rank's local position ids (sliding window), by ring rank
    window: int | None


def _keep(setup: _Setup, rank: int, source: int, piece: Piece) -> torch.Tensor | None | bool:
    """The piece's mask ([B, 1, Sq, Sk], True = attend) from documents and the sliding window; None without
    either; False when nothing in the piece is visible (the piece is skipped)."""
    keep = None
    if setup.segments is not None:
        seg_q, seg_k = setup.segments[rank][:, piece.q], setup.segments[source][:, piece.kv]
        keep = seg_q[:, :, None] == seg_k[:, None, :]
    if setup.window is not None:
        # HF's sliding window: q_pos - kv_pos < window (positions rise by one inside a document)
        pos_q, pos_k = setup.positions[rank][:, piece.q], setup.positions[source][:, piece.kv]
        near = (pos_q[:, :, None] - pos_k[:, None, :]) < setup.window
        keep = near if keep is None else keep & near
    if keep is None:
        return None
    return keep.unsqueeze(1) if bool(keep.any()) else False


def _pieces(setup: _Setup, rank: int, source: int, local_len: int):
    for piece in step_pieces(rank, source, local_len, setup.causal, setup.zigzag):
        keep = _keep(setup, rank, source, piece)
        if keep is not False:
            yield piece, keep


def _ring_forward(setup: _Setup, q, k, v):
    ring = _Ring(setup.group) if setup.world > 1 else None
    out = q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float32)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    k_cur, v_cur = k, v
    for step in range(setup.world):
        source = (setup.rank - step) % setup.world
        if step + 1 < setup.world:
            ring.start([k_cur, v_cur])
        for piece, keep in _pieces(setup, setup.rank, source, q.shape[2]):
            blk_out, blk_lse = block_forward(q[:, :, piece.q], k_cur[:, :, piece.kv], v_cur[:, :, piece.kv],
                                             causal=piece.causal, scale=setup.scale, keep=keep)
            merge_into(out[:, :, piece.q], lse[:, :, piece.q], blk_out, blk_lse)
        if step + 1 < setup.world:
            k_cur, v_cur = ring.wait()
    return out.to(q.dtype), lse


def _ring_backward(setup: _Setup, dout, q, k, v, out, lse):
    ring = setup.world > 1
    kv_ring, grad_ring = (_Ring(setup.group), _Ring(setup.group, tag_base=2)) if ring else (None, None)
    dq = torch.zeros_like(q, dtype=torch.float32)
    k_cur, v_cur = k, v
    dk_cur, dv_cur = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    for step in range(setup.world):
        source = (setup.rank - step) % setup.world
        if step + 1 < setup.world:
            kv_ring.start([k_cur, v_cur])
        for piece, keep in _pieces(setup, setup.rank, source, q.shape[2]):
            qs, ks = piece.q, piece.kv
            gq, gk, gv = block_backward(dout[:, :, qs], q[:, :, qs], k_cur[:, :, ks], v_cur[:, :, ks],
                                        out[:, :, qs], lse[:, :, qs], causal=piece.causal, scale=setup.scale,
                                        keep=keep)
            dq[:, :, qs] += gq
            dk_cur[:, :, ks] += gk
            dv_cur[:, :, ks] += gv
        if not ring:
            break
        # This K/V's gradient moves on with it; after the last step every accumulator is back on its owner.
        grad_ring.start([dk_cur, dv_cur])
        if step + 1 < setup.world:
            k_cur, v_cur = kv_ring.wait()
        dk_cur, dv_cur = grad_ring.wait()
    return dq.to(q.dtype), dk_cur.to(k.dtype), dv_cur.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, setup: _Setup):
        out, lse = _ring_forward(setup, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.setup = setup
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.setup, dout, q, k, v, out, lse)
        return dq, dk, dv, None


def _check(query, key, value, world: int, causal: bool, zigzag: bool, segment_ids, window=None,
           position_ids=None) -> None:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("ring_attention: query, key and value must be 4-D [batch, heads, seq_local, head_dim]")
    if key.shape[1] != value.shape[1] or query.shape[1] % key.shape[1]:
        raise ValueError(f"ring_attention: query heads {query.shape[1]} must be a multiple of key/value heads "
                         f"{key.shape[1]} (and key and value must have the same head count)")
    if not (query.shape[2] == key.shape[2] == value.shape[2]):
        raise ValueError("ring_attention: query, key and value must hold the same local sequence slice")
    if zigzag and causal and query.shape[2] % 2:
        raise ValueError(f"ring_attention: zigzag needs an even local length (2 chunks per rank), got "
                         f"{query.shape[2]}; pad the sequence to a multiple of 2 * cp={2 * world} (split.py)")
    for name, ids in (("segment_ids", segment_ids), ("position_ids", position_ids)):
        if ids is not None and tuple(ids.shape) != (query.shape[0], query.shape[2]):
            raise ValueError(f"ring_attention: {name} must be [batch, seq_local]="
                             f"{[query.shape[0], query.shape[2]]}, got {list(ids.shape)}")
    if window is not None and (not causal or position_ids is None or window < 1):
        raise ValueError(f"ring_attention: sliding_window={window} needs causal attention, a window >= 1 and the "
                         f"global position_ids of the local tokens")


def _gather_ids(ids: torch.Tensor | None, group, world: int) -> list[torch.Tensor] | None:
    """Every ring rank's [B, S_local] ids (small integer tensors, gathered once per call)."""
    if ids is None:
        return None
    parts = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(parts, ids.contiguous(), group=group)
    return parts


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    zigzag: bool = False,
    segment_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence held across `group` (None: the default group),
    differentiable.

    query [B, Nq, S_local, D], key / value [B, Nkv, S_local, D(v)] of this rank's slice (contiguous or `zigzag`
    layout, see split.py); returns [B, Nq, S_local, Dv] in query's dtype. `scale` defaults to D ** -0.5.
    `segment_ids` [B, S_local]: packed-document ids (equal = same document); attention stays inside documents.
    `sliding_window` (causal only) keeps keys with q_pos - k_pos < window, from the global `position_ids`.
    """
    group = dist.group.WORLD if group is None else group
    world = dist.get_world_size(group)
    _check(query, key, value, world, causal, zigzag, segment_ids, sliding_window, position_ids)
    scale = float(scale if scale is not None else query.shape[-1] ** -0.5)
    setup = _Setup(group, dist.get_rank(group), world, causal, scale, zigzag, _gather_ids(segment_ids, group, world),
                   _gather_ids(position_ids if sliding_window else None, group, world), sliding_window)
    return _RingAttention.apply(query, key, value, setup)


def local_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    segment_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention on one rank (no group): the device block kernel with its backward, differentiable.
    Arguments as ring_attention's; the Ulysses inner kernel when there is no ring."""
    _check(query, key, value, 1, causal, False, segment_ids, sliding_window, position_ids)
    scale = float(scale if scale is not None else query.shape[-1] ** -0.5)
    setup = _Setup(None, 0, 1, causal, scale, False, None if segment_ids is None else [segment_ids],
                   [position_ids] if sliding_window else None, sliding_window)
    return _RingAttention.apply(query, key, value, setup)
