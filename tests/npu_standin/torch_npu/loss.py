"""npu_cross_entropy_loss: cross entropy over [N, C] logits, computed in fp32, loss returned in the logits dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _checks as C

MAX_ROWS = 200_000
REDUCTIONS = ("mean", "sum", "none")


def npu_cross_entropy_loss(input, target, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0,
                           lse_square_scale_for_zloss=0.0, return_zloss=False):
    """(loss, log_prob, zloss, lse_for_zloss). loss has input's dtype and shape [1] ('mean'/'sum') or [N]
    ('none'); ignore_index and label_smoothing follow torch. zloss outputs are empty (z-loss not modelled).
    With requires_grad and reduction='mean', every other argument must keep its default (device limit).
    """
    op = "npu_cross_entropy_loss"
    x = C.float_tensor(op, "input", input)
    target = C.tensor(op, "target", target)
    reduction = C.string(op, "reduction", reduction)
    ignore_index = C.integer(op, "ignore_index", ignore_index)
    label_smoothing = C.real(op, "label_smoothing", label_smoothing)
    z_scale = C.real(op, "lse_square_scale_for_zloss", lse_square_scale_for_zloss)
    C.check(x.dim() == 2, op, f"input must be [N, C], got shape {list(x.shape)}")
    C.check(x.shape[0] <= MAX_ROWS, op, f"input has {x.shape[0]} rows; at most {MAX_ROWS} are supported")
    C.check(target.dtype == torch.int64, op, f"target must be int64, got {target.dtype}")
    C.check(tuple(target.shape) == (x.shape[0],), op, f"target must be [N={x.shape[0]}], got {list(target.shape)}")
    C.check(reduction in REDUCTIONS, op, f"reduction must be one of {REDUCTIONS}, got {reduction!r}", ValueError)
    C.check(0.0 <= label_smoothing <= 1.0, op, f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if weight is not None:
        weight = C.tensor(op, "weight", weight)
        C.check(weight.dtype == torch.float32, op, f"weight must be float32, got {weight.dtype}")
        C.check(tuple(weight.shape) == (x.shape[1],), op, f"weight must be [C={x.shape[1]}]")
    if z_scale != 0.0 or return_zloss:
        raise C.unsupported(op, "z-loss (lse_square_scale_for_zloss / return_zloss)")
    if torch.is_grad_enabled() and x.requires_grad and reduction == "mean":
        C.check(
            weight is None and ignore_index == -100 and label_smoothing == 0.0, op,
            "with requires_grad and reduction='mean', weight, ignore_index and label_smoothing must stay at "
            "their defaults",
        )
    log_prob = torch.log_softmax(x.float(), dim=-1)
    loss = F.nll_loss(log_prob, target, weight=weight, ignore_index=ignore_index, reduction=reduction) \
        if label_smoothing == 0.0 else F.cross_entropy(
            x.float(), target, weight=weight, ignore_index=ignore_index, reduction=reduction,
            label_smoothing=label_smoothing,
        )
    loss = loss.to(x.dtype).reshape(-1 if reduction == "none" else 1)
    empty = x.new_empty(0)
    return loss, log_prob.detach().to(x.dtype), empty, empty.float()
