"""Context parallelism for a loop that does not know about it: the model splits the batch itself.

An accelerate loop calls `model(**batch)` with the whole batch, the same on every rank of a cp group (the data loader
hands a cp group the same batches). A model prepared with `parallel.cp > 1` gets two hooks on its outermost module:

- before the forward: this rank's share of the batch (`split_cp_batch`: the tokens of this rank's slice, global
  positions, labels shifted globally; a batch split already - Trainer's compute_loss splits its own - is left alone);
- after it: the loss's value made the cp group's mean - one process's loss on the whole sequence - while its
  gradient stays this rank's (`loss + (mean - loss).detach()`): FSDP2's average over dp_shard x cp then gives one
  process's gradients, and the loss a loop logs is one process's.

A forward without labels under cp returns this rank's slice of the logits; that is said once.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.context.attached import context_of
from ..parallel.context.multimodal import SPLIT_MARK

__all__ = ["install_loop_split"]

logger = logging.getLogger("mindspeed_hf")
_HOOKED = "_mindspeed_loop_split"
_SPLITTING = "_mindspeed_loop_splitting"


def install_loop_split(model: nn.Module) -> None:
    """Hook `model` (the outermost module a loop calls) to split its batches over its cp group; nothing without
    context parallelism. Idempotent."""
    if context_of(model) is None or getattr(model, _HOOKED, False):
        return
    model.register_forward_pre_hook(_split, with_kwargs=True)
    model.register_forward_hook(_cp_mean_loss, with_kwargs=True)
    setattr(model, _HOOKED, True)


def _split(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    if SPLIT_MARK in kwargs:  # split already (Trainer's compute_loss)
        return None
    if args:  # model(input_ids, ...): HF's forwards take input_ids first
        kwargs = {"input_ids": args[0], **kwargs}
        if len(args) > 1:
            raise ValueError("parallel.cp: pass the model its inputs by name (model(**batch)) so the batch can be "
                             "split across the cp group")
    ctx = context_of(module)
    if kwargs.get("labels") is None and module.training and not getattr(module, "_mindspeed_said_logits", False):
        module._mindspeed_said_logits = True
        logger.warning("mindspeed_hf: parallel.cp=%d: the model was called without labels, so its outputs hold this "
                       "rank's slice of each sequence; pass labels to let the model compute the whole sequence's "
                       "loss", ctx.cp)
    from ..parallel.context.model import split_cp_batch

    local = split_cp_batch(kwargs, ctx, num_items_in_batch=kwargs.get("num_items_in_batch"))
    setattr(module, _SPLITTING, getattr(module, _SPLITTING, 0) + 1)
    return (), local


def _cp_mean_loss(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
    depth = getattr(module, _SPLITTING, 0)
    if not depth:
        return None
    setattr(module, _SPLITTING, depth - 1)
    loss = output.get("loss") if isinstance(output, dict) else (
        output[0] if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor) else None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        return None
    ctx = context_of(module)
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=ctx.group)
    mean /= ctx.cp
    loss = loss + (mean - loss.detach())
    if isinstance(output, dict):
        output["loss"] = loss
        return output
    return (loss, *output[1:])
