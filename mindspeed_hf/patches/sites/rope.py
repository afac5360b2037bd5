"""The rope site: the modeling module's rope functions (apply_rotary_pos_emb, and the family's others in their
layouts: ModelFamily.rope_layouts) and its multimodal (M-RoPE) ones run the fused rope, switched by kernels.rope.
(The vision rope and the sectioned M-RoPE of the VLMs: multimodal.py.)"""

from __future__ import annotations

from types import ModuleType

from .. import forwards, third_party
from ..families import ModelFamily
from ..patching import switch


def patch(family: ModelFamily, module: ModuleType) -> None:
    """Switch the module's rope functions the family lists."""
    for function, layout in family.rope_layouts:
        if hasattr(module, function):  # (4.57's Qwen2(.5)-VL: multimodal rope only)
            switch(module, function, "rope", forwards.ROPE_LAYOUTS[layout])
    for _, function in family.mrope_attention:
        switch(module, function, "rope", third_party.mrope_function(getattr(module, function)))
