"""Kernels for families whose modeling lives outside transformers (ModelFamily.modeling, e.g. the qwen-tts
package's Qwen3-TTS): the module is looked up among the imported ones, never imported here, so `import
mindspeed_hf` pulls in no third-party package; and the multimodal rope those models carry.

Multimodal rope (Qwen2-VL style, `apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section,
mrope_interleaved=False, unsqueeze_dim=1)`, cos/sin of shape (3, B, T, D)) picks each frequency band from one of
the three position rows. Where the three rows are equal (text-only and TTS sequences: the rows are one position
expanded three times) every band comes from the same row, so the result is plain rope with row 0, which the fused
rope kernel computes (the interleaved layout also needs the usual cat(freqs, freqs) tables). Other inputs keep the
original function."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ..ops.rotary import apply_rotary_pos_emb
from .forwards import tag


def imported_module(path: str) -> ModuleType | None:
    """The module at `path` if its package was already imported by the user, else None (never imports it)."""
    return sys.modules.get(path)


def rows_equal(table: torch.Tensor) -> bool:
    """Whether every row along dim 0 of a (rows, B, T, D) cos/sin table equals the first."""
    return table.dim() == 4 and bool((table == table[:1]).all())


def halves_equal(cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether both tables repeat their first half (the rotary modules' cat(freqs, freqs)), which the interleaved
    layout assumes: it reads only the first half."""
    half = cos.shape[-1] // 2
    return all(bool((t[..., :half] == t[..., half:]).all()) for t in (cos, sin))


def mrope_function(original: Callable) -> Callable:
    """A replacement for a module's `apply_multimodal_rotary_pos_emb`: the fused rope where all position rows are
    equal, `original` otherwise."""

    @functools.wraps(original)
    def apply_multimodal_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                        mrope_section: Any, mrope_interleaved: bool = False,
                                        unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if rows_equal(cos) and rows_equal(sin) and (not mrope_interleaved or halves_equal(cos, sin)):
            return apply_rotary_pos_emb(q, k, cos[0], sin[0], unsqueeze_dim)
        return original(q, k, cos, sin, mrope_section, mrope_interleaved, unsqueeze_dim)

    return tag("rope", apply_multimodal_rotary_pos_emb)
