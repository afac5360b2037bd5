"""The two primitives every kernel site patches with, both through the process's patch record (engine.PATCHES), so
that disable() puts back every original: switch() (a kernel switched by its setting) and set_once() (a fix that
applies whenever the package is enabled). Neither patches an attribute twice, which keeps enable() idempotent."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import scope
from .engine import PATCHES


def switch(owner: Any, name: str, op: str, fast: Callable, base: Callable | None = None,
           reported_as: str | None = None, layer_forward: bool = False) -> bool:
    """owner.name -> `fast` while the current config has `op` on, `base` (default: the original) otherwise, unless
    owner.name is patched already. `reported_as`: the op report() counts the site under, where it is not `op` (the
    fused add of a decoder layer, "add_rms_norm", switched with rms_norm). A loss head's forward (op
    fused_linear_cross_entropy on "forward") also enters the model's own scope when it is called past its hooks
    (scope.switch's model_forward). `layer_forward`: a decoder layer's forward, which enters its model's scope itself
    (scope.switch's layer_forward). Returns whether it patched."""
    if PATCHES.is_patched(owner, name):
        return False
    head = op == "fused_linear_cross_entropy" and name == "forward"
    switched = scope.switch(op, fast, getattr(owner, name) if base is None else base, model_forward=head,
                            layer_forward=layer_forward)
    if reported_as is not None:
        switched._mindspeed_op = reported_as
    PATCHES.set(owner, name, switched)
    return True


def set_once(owner: Any, name: str, value: Any) -> None:
    """owner.name = value, unless it is patched already; no kernel switch: for fixes that apply whenever the
    package is enabled."""
    if not PATCHES.is_patched(owner, name):
        PATCHES.set(owner, name, value)
