"""The one log line per model that says what the accelerator applied to it (again only if that changed)."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

logger = logging.getLogger("mindspeed_hf")


def announce(model: nn.Module, result: dict[str, Any]) -> None:
    """Log what was applied, once per model (and again only if it changed)."""
    applied = ", ".join(f"{op} x{n}" for op, n in result["kernels"].items() if n) or "nothing"
    line = f"mindspeed_hf: {result['model_type']} on backend {result['backend']}: {applied}"
    if "vision_kernels" in result:
        vision = ", ".join(f"{op} x{n}" for op, n in result["vision_kernels"].items() if n) or "nothing"
        line += f"; vision tower: {vision}"
    if result.get("audio_kernels", {}).get("attention"):
        line += f"; audio tower: attention x{result['audio_kernels']['attention']}"
    if result.get("hf_path"):
        line += f"; HF's code where ours gains nothing here: {', '.join(result['hf_path'])}"
    if getattr(model, "_mindspeed_announced", None) != line:
        model._mindspeed_announced = line
        logger.info(line)
