"""The patch engine: every replaced attribute is recorded with its original, so that disable() puts back the
exact objects (or removes attributes that did not exist before). Patching the same attribute twice keeps the
first original, which makes enable() idempotent."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

_MISSING = object()


def _own(owner: Any, name: str) -> Any:
    """`owner`'s own `name` (not an inherited one); a closure cell's contents when `owner` is a cell."""
    if isinstance(owner, types.CellType):
        return owner.cell_contents
    return vars(owner).get(name, _MISSING)


@dataclass
class Patch:
    owner: Any
    name: str
    original: Any
    value: Any = None  # what we set


class PatchSet:
    """An ordered record of patched attributes on modules, classes or instances, and of closure cells (name
    "cell_contents": a function a wrapper of HF's calls, replaced inside the wrapper)."""

    def __init__(self) -> None:
        self._patches: dict[tuple[int, str], Patch] = {}

    def set(self, owner: Any, name: str, value: Any) -> None:
        key = (id(owner), name)
        if key not in self._patches:
            # Read the owner's own dict: an inherited attribute must be deleted, not copied, on restore.
            self._patches[key] = Patch(owner, name, _own(owner, name))
        self._patches[key].value = value
        setattr(owner, name, value)

    def original(self, owner: Any, name: str) -> Any:
        """The attribute as it was before patching (resolved through the class hierarchy if it was inherited)."""
        patch = self._patches.get((id(owner), name))
        if patch is None:
            return getattr(owner, name)
        if patch.original is _MISSING:
            return getattr(super(owner, owner), name) if isinstance(owner, type) else None
        return patch.original

    def is_patched(self, owner: Any, name: str) -> bool:
        return (id(owner), name) in self._patches

    def replaced(self) -> list[Patch]:
        """The patches whose attribute somebody else has since replaced (`vars(owner)[name]` is no longer `value`)."""
        return [p for p in self._patches.values() if _own(p.owner, p.name) is not p.value]

    def restore_all(self) -> None:
        for patch in reversed(list(self._patches.values())):
            if patch.original is _MISSING:
                if patch.name in vars(patch.owner):
                    delattr(patch.owner, patch.name)
            else:
                setattr(patch.owner, patch.name, patch.original)
        self._patches.clear()

    def __len__(self) -> int:
        return len(self._patches)


#: The process's record of what enable() patched (disable() restores it), written by patches/patching.py and read by
#: patches/reporting.py (replacements()).
PATCHES = PatchSet()
#: Decoder-layer classes whose residual add runs fused into the norm after it (report()'s add_rms_norm_layers).
FUSED_LAYERS: set[type] = set()
