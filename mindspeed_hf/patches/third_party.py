"""Kernels for families whose modeling lives outside transformers (ModelFamily.modeling, e.g. the qwen-tts
package's Qwen3-TTS): the module is looked up among the imported ones, never imported here, so `import
mindspeed_hf` pulls in no third-party package; and the multimodal rope those models carry.

Multimodal rope (`apply_multimodal_rotary_pos_emb`, cos/sin of shape (3, B, T, D)) picks each frequency band from
one of the three position rows: the tables are folded into one as the original does, on the device, and the fused
rope kernel applies to any input."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
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


class _AfterImport(importlib.abc.MetaPathFinder):
    """A finder that finds nothing itself: for the watched module names it lets the other finders find the module
    and wraps their loader, so that `callback(module)` runs right after the module's code ran (whatever imports it:
    the user's `import qwen_tts`, before or after ours)."""

    def __init__(self) -> None:
        self.watched: dict[str, list[Callable[[ModuleType], None]]] = {}

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        callbacks = self.watched.get(name)
        if not callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _CallbackLoader(spec.loader, tuple(callbacks))
                return spec
        return None


class _CallbackLoader(importlib.abc.Loader):
    """The module's own loader, then the callbacks."""

    def __init__(self, loader: Any, callbacks: tuple[Callable[[ModuleType], None], ...]) -> None:
        self.loader, self.callbacks = loader, callbacks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        for callback in self.callbacks:
            callback(module)


_finder = _AfterImport()


def when_imported(path: str, callback: Callable[[ModuleType], None]) -> None:
    """`callback(module)` once the module at `path` is imported: now if it already is, else right after its import
    (never imports it; several callbacks per module run in the order given). Also how transformers' own families
    are patched: at their modeling module's import, so `import mindspeed_hf` imports none. Undone by
    `stop_watching()`."""
    module = imported_module(path)
    if module is not None:
        callback(module)
        return
    _finder.watched.setdefault(path, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def stop_watching() -> None:
    """Forget every `when_imported` request and take the finder off sys.meta_path."""
    _finder.watched.clear()
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


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
