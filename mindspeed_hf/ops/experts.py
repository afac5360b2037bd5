"""Grouped-GEMM experts: the MLP of every routed expert over tokens already grouped by expert.

`grouped_mlp` is the contract the experts kernel and expert parallelism share: rows of `x` are sorted by expert
(the first counts[0] rows go to expert 0, the next counts[1] to expert 1, ...), each group runs
down(gate(gate_up(x))) with its own expert's weights (HF's fused 3-D layout: gate_up [E, 2I, H], down [E, H, I]),
and the output keeps the input's row order. Routing weights are not applied here: `permute` groups a batch's
tokens by expert and `unpermute` brings them back, weighted (expert parallelism sends the groups between them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def grouped_mlp(x: torch.Tensor, counts: Sequence[int] | torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                apply_gate: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Per-expert MLP over `x` [N, H] grouped by `counts` (E entries, summing to N); returns [N, H].

    `apply_gate` maps the [n, 2I] gate_up output to [n, I] (default: silu(first half) * second half).
    """
    apply_gate = apply_gate or _silu_gate
    counts = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
    if len(counts) != gate_up.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_mlp: counts {counts} do not match {gate_up.shape[0]} experts and {x.shape[0]} rows")
    outputs = []
    for expert, rows in zip(range(len(counts)), x.split(counts)):
        if rows.shape[0]:
            outputs.append(F.linear(apply_gate(F.linear(rows, gate_up[expert])), down[expert]))
    if not outputs:  # no tokens here: an empty result that still reaches the weights in backward
        return x.new_zeros(0, down.shape[1]) + 0 * (gate_up.sum() + down.sum())
    return torch.cat(outputs)


@dataclass(frozen=True)
class Routing:
    """Where each (token, top-k slot) went: `order[i]` is the flat [T * k] index of sorted row i."""

    order: torch.Tensor  # int64 [T * k]
    counts: torch.Tensor  # int64 [E]: rows per expert, in expert order
    num_tokens: int
    top_k: int


def permute(hidden: torch.Tensor, top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, Routing]:
    """Rows of `hidden` [T, H] repeated per top-k slot and grouped by expert (stable): ([T * k, H], Routing)."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    routing = Routing(order, counts, hidden.shape[0], top_k_index.shape[-1])
    return hidden.index_select(0, order // routing.top_k), routing


def unpermute(rows: torch.Tensor, routing: Routing, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Inverse of `permute`: each token's k expert outputs weighted by `top_k_weights` [T, k] and summed, in fp32;
    returns [T, H] in the rows' dtype."""
    per_slot = torch.empty_like(rows).index_copy(0, routing.order, rows)
    per_slot = per_slot.view(routing.num_tokens, routing.top_k, -1)
    out = (per_slot.float() * top_k_weights.float().unsqueeze(-1)).sum(dim=1)
    return out.to(rows.dtype)
