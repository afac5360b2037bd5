"""The cross-entropy of a vocab-parallel lm_head (tensor parallelism: its weight a DTensor ``Shard(0)`` over the tp
ranks) from each rank's own vocabulary slice: the [chunk, V/tp] logits of a chunk are never gathered; the row max,
the sum of exponentials and the target logit are all-reduced over tp (three [chunk] vectors instead of [chunk, V]
logits). ops/fused_linear_cross_entropy.py takes this path for such a head; parallel/tensor.py builds the heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from .registry import register

__all__ = ["GradAllReduce", "OP", "is_vocab_parallel_head", "vocab_parallel_cross_entropy",
           "vocab_parallel_linear_cross_entropy"]

#: counted in report()["ran"] once per loss that takes this path
OP = "vocab_parallel_cross_entropy"


def is_vocab_parallel_head(head: nn.Module) -> bool:
    """Whether `head` is an nn.Linear (its own forward: no PEFT / quantized wrapper) without bias whose weight is a
    DTensor ``Shard(0)`` on a 1-D mesh, with its local slice of the vocabulary at hand (not a sharded FSDP2 unit)."""
    from torch.distributed.tensor import DTensor, Shard

    weight = getattr(head, "weight", None)
    return (type(head) is nn.Linear and head.bias is None and isinstance(weight, DTensor)
            and weight.placements == (Shard(0),) and weight.device_mesh.ndim == 1)


class GradAllReduce(torch.autograd.Function):
    """Identity forward; the gradient summed over `group` (a replicated input whose users each saw a part)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _VocabParallelCE(torch.autograd.Function):
    """Summed cross-entropy of local logits [n, V/tp] (this rank's vocab slice from `start`) against global
    targets [n]: row max, sum of exp and the target logit all-reduced over `group`."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, start: int, group: dist.ProcessGroup):
        logits = logits.float()
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        probs = (logits - row_max.unsqueeze(-1)).exp()
        denom = probs.sum(dim=-1)
        dist.all_reduce(denom, group=group)
        local = target - start
        mine = (local >= 0) & (local < logits.shape[-1])
        rows = torch.arange(target.numel(), device=target.device)
        picked = torch.where(mine, logits[rows, local.clamp(0, logits.shape[-1] - 1)], 0.0)
        dist.all_reduce(picked, group=group)
        probs /= denom.unsqueeze(-1)
        ctx.save_for_backward(probs, local, mine)
        return (row_max + denom.log() - picked).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        probs, local, mine = ctx.saved_tensors
        rows = torch.arange(local.numel(), device=local.device)[mine]
        out = probs.clone()
        out[rows, local[mine]] -= 1.0
        return out * grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int,
                                 group: dist.ProcessGroup) -> torch.Tensor:
    """``F.cross_entropy(full_logits, target, reduction="sum")`` from this rank's vocab slice ``[n, V/tp]``
    (columns ``start .. start + V/tp`` of the full logits); every target must be valid (filter ignored rows
    first). Differentiable in `logits`; the gradient of each rank's slice is local (no communication)."""
    return _VocabParallelCE.apply(logits, target, start, group)


def vocab_parallel_linear_cross_entropy(hidden: torch.Tensor, head: nn.Module, target: torch.Tensor,
                                        chunk_size: int = 1024) -> torch.Tensor:
    """Summed ``cross_entropy(head(hidden), target)`` for a vocab-parallel lm_head (``weight`` a DTensor
    ``Shard(0)`` on a 1-D tp mesh, no bias), chunk by chunk on the local weight: the [chunk, V/tp] logits are
    recomputed in the backward (checkpoint), never gathered. `hidden` [n, H] is the same on every tp rank and
    every `target` valid. The weight gradient stays on its shard; the hidden gradient is summed over tp."""
    if not is_vocab_parallel_head(head):
        raise ValueError("vocab_parallel_linear_cross_entropy: the lm_head must be an nn.Linear without bias whose "
                         "weight is a DTensor Shard(0) on a 1-D tp mesh")
    weight = head.weight
    group = weight.device_mesh.get_group()
    rank, tp = weight.device_mesh.get_local_rank(), weight.device_mesh.size()
    start = rank * -(-weight.shape[0] // tp)  # torch.chunk's split, as DTensor's Shard(0)
    local = weight.to_local()
    if torch.is_grad_enabled():
        hidden = GradAllReduce.apply(hidden, group)

    def chunk_loss(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(nn.functional.linear(h, w), t, start, group)

    total = hidden.new_zeros((), dtype=torch.float32)
    # at least one chunk: with no rows the head still joins the backward (zero gradients), as on the ranks with rows
    for first in range(0, max(1, hidden.shape[0]), chunk_size):
        rows = slice(first, first + chunk_size)
        if torch.is_grad_enabled():
            total = total + checkpoint(chunk_loss, hidden[rows], local, target[rows], use_reentrant=False)
        else:
            total = total + chunk_loss(hidden[rows], local, target[rows])
    return total


@register(OP, "torch", name="torch:vocab-parallel chunks")
def _counted(hidden: torch.Tensor, head: nn.Module, target: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """The registry's entry (one implementation: plain torch ops and collectives on every device)."""
    return vocab_parallel_linear_cross_entropy(hidden, head, target, chunk_size)
