"""Kernels for families whose modeling lives outside transformers (ModelFamily.modeling, e.g. the qwen-tts
package's Qwen3-TTS): the module is looked up among the imported ones, never imported here, so `import
mindspeed_hf` pulls in no third-party package; and the multimodal rope those models carry.

Multimodal rope (`apply_multimodal_rotary_pos_emb`, cos/sin of shape (3, B, T, D)) picks each frequency band from
one of the three position rows: the tables are folded into one as the original does, on the device, and the fused
rope kernel applies to any input."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ..ops.rotary import apply_rotary_pos_emb, multimodal_rope_tables
from .forwards import tag


def imported_module(path: str) -> ModuleType | None:
    """The module at `path` if its package was already imported by the user, else None (never imports it)."""
    return sys.modules.get(path)


def mrope_function(original: Callable) -> Callable:
    """A replacement for a module's `apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section,
    mrope_interleaved=False, unsqueeze_dim=1)`: its tables folded exactly as the original folds them
    (ops.rotary.multimodal_rope_tables), then the fused rope."""

    @functools.wraps(original)
    def apply_multimodal_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                        mrope_section: Any, mrope_interleaved: bool = False,
                                        unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = multimodal_rope_tables(cos, sin, mrope_section, mrope_interleaved)
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)

    return tag("rope", apply_multimodal_rotary_pos_emb)
