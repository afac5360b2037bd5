"""Grouped-GEMM experts: the MLP of every routed expert over tokens already grouped by expert.

`grouped_mlp` is the contract the experts kernel and expert parallelism share: rows of `x` are sorted by expert
(the first counts[0] rows go to expert 0, the next counts[1] to expert 1, ...), each group runs
down(gate(gate_up(x))) with its own expert's weights (HF's fused 3-D layout: gate_up [E, 2I, H], down [E, H, I]),
and the output keeps the input's row order. Routing weights are not applied here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
