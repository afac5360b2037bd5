"""Which context parallelism a model was prepared with: read by every step's batch split, so it loads without the
attention machinery (model.py attaches it; docs/host_time.md on what the import costs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from .model import ContextParallel


def context_of(model: nn.Module) -> ContextParallel | None:
    """The ContextParallel a model was prepared with (None without context parallelism); looks through PEFT."""
    for module in (model, getattr(model, "base_model", None), getattr(getattr(model, "base_model", None), "model",
                                                                      None)):
        ctx = getattr(module, "_mindspeed_cp", None) if module is not None else None
        if ctx is not None:
            return ctx
    return None
