"""Recompute (activation checkpointing): one setting, `memory.recompute`, mapped onto HF's own switch."""

from __future__ import annotations

import logging

from torch import nn

from ..compat import enable_activation_checkpointing

logger = logging.getLogger("mindspeed_hf")


def enable_recompute(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing through HF's own switch (also through a PEFT wrapper).

    Non-reentrant because the reentrant variant needs inputs that require grad (breaks frozen-base LoRA) and
    does not compose with FSDP2.
    """
    if not enable_activation_checkpointing(model, {"use_reentrant": False}):
        logger.warning("mindspeed_hf: recompute asked for, but %s has no activation checkpointing switch; it is off",
                       type(model).__name__)
        return
    logger.info("mindspeed_hf: recompute is on (non-reentrant activation checkpointing on every decoder layer)")
