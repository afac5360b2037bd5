"""Ulysses sequence parallelism: an all-to-all that trades the sequence split for a head split, and back.

Before attention (after RoPE, which ran on each rank's slice with global position ids) q / k / v go from
[B, N, S_local, D] (every head, this rank's slice) to [B, N / U, S_local * U, D] (N / U heads, the whole sequence
of the Ulysses group, slices in group-rank order); any attention kernel then runs on the full sequence; the output
goes back to [B, N, S_local, D]. Both all-to-alls are autograd functions whose backward is the inverse all-to-all.

GQA with fewer kv heads than U: each kv head is repeated U / Nkv times first (a query head h keeps reading kv head
h // (Nq / Nkv) after the split), and the repeat's backward sums the copies' gradients.

Hybrid (Ulysses inside, ring across): a cp = ring x U group laid out as a DeviceMesh ("ring", "ulysses") with
Ulysses innermost (fast all-to-all between neighbouring ranks); `ulysses_attention(..., attn_fn=partial(
ring_attention, group=ring_group, ...))` runs the ring on each Ulysses group's gathered piece (split.py's
`hybrid` layout hands rank (ring r, ulysses j) the j-th contiguous part of ring piece r).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all: split `scatter_dim` over the group, concatenate the received parts along
    `gather_dim` in group-rank order. `scatter_dim`'s size must be a multiple of the group size."""
    world = dist.get_world_size(group)
    if x.shape[scatter_dim] % world:
        raise ValueError(f"all_to_all: dimension {scatter_dim} of size {x.shape[scatter_dim]} does not split over "
                         f"{world} ranks")
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, N, S_local, D] -> [B, N / U, S_local * U, D] over the Ulysses group."""
    return all_to_all(x, group, scatter_dim=1, gather_dim=2)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[B, N / U, S, D] -> [B, N, S / U, D]: the inverse of seq_to_heads."""
    return all_to_all(x, group, scatter_dim=2, gather_dim=1)


def check_ulysses_heads(num_heads: int, num_kv_heads: int, ulysses: int) -> None:
    """One-line error before any work when the heads cannot be split over `ulysses` ranks."""
    if num_heads % ulysses:
        raise ValueError(f"parallel.cp_ulysses={ulysses} must divide the number of attention heads {num_heads}; "
                         f"valid Ulysses sizes: {[u for u in range(1, num_heads + 1) if num_heads % u == 0]}")
    if num_kv_heads % ulysses and ulysses % num_kv_heads:
        raise ValueError(f"parallel.cp_ulysses={ulysses} and the {num_kv_heads} key/value heads: one must divide "
                         f"the other (kv heads are repeated up to the Ulysses size)")


def repeat_kv_heads(x: torch.Tensor, ulysses: int) -> torch.Tensor:
    """[B, Nkv, S, D] with Nkv < ulysses: each head repeated ulysses / Nkv times (gradients sum back)."""
    nkv = x.shape[1]
    return x if nkv % ulysses == 0 else x.repeat_interleave(ulysses // nkv, dim=1)


def gather_sequence_ids(ids: torch.Tensor, group) -> torch.Tensor:
    """[B, S_local] per-token ids (segment ids, positions) -> [B, S_local * U], the Ulysses group's piece."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(parts, ids.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup,
    attn_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Attention over the Ulysses group's whole sequence with heads split across it, differentiable.

    query [B, Nq, S_local, D], key / value [B, Nkv, S_local, D] (this rank's slice, all heads); `attn_fn(q, k, v)`
    gets [B, Nq / U, S, D] / [B, max(Nkv, U) / U, S, D] and returns [B, Nq / U, S, Dv] (a local kernel on the
    full sequence, or a ring over the ring group for the hybrid). Returns [B, Nq, S_local, Dv].
    """
    ulysses = dist.get_world_size(group)
    check_ulysses_heads(query.shape[1], key.shape[1], ulysses)
    key, value = repeat_kv_heads(key, ulysses), repeat_kv_heads(value, ulysses)
    q, k, v = (seq_to_heads(t, group) for t in (query, key, value))
    return heads_to_seq(attn_fn(q, k, v), group)
