"""The rms_norm site: the family's RMSNorm classes run the rms_norm kernel, and its decoder layer's residual add
runs fused into the norm after it (reported as add_rms_norm), both switched by kernels.rms_norm."""

from __future__ import annotations

from types import ModuleType

from ...releases import compat
from .. import forwards
from ..engine import FUSED_LAYERS, PATCHES
from ..families import ModelFamily
from ..patching import switch


def patch(family: ModelFamily, module: ModuleType) -> None:
    """Switch the family's norm forwards and its decoder layer's forward (or the function a checkpointing wrapper
    of its forward calls)."""
    norm_forward = forwards.offset_rms_norm_forward if family.offset_rms_norm else forwards.rms_norm_forward
    # VLMs: 4.57 imports some of these classes from the text family's module
    norms = tuple(getattr(module, name) for name in family.rms_norm if hasattr(module, name))
    for cls in norms:
        switch(cls, "forward", "rms_norm", norm_forward)
    layer = getattr(module, family.decoder_layer, None) if family.decoder_layer else None
    if layer is None:
        return
    owner, name = compat.layer_forward_slot(layer)
    if PATCHES.is_patched(owner, name):
        return
    fused = forwards.fused_layer(getattr(owner, name), norms, family.offset_rms_norm)
    if fused is not None and switch(owner, name, "rms_norm", fused, reported_as="add_rms_norm",
                                     layer_forward=True):
        FUSED_LAYERS.add(layer)
