"""The rope site: the modeling module's apply_rotary_pos_emb and its multimodal (M-RoPE) rope functions run the
fused rope, switched by kernels.rope. (The vision rope and the sectioned M-RoPE of the VLMs: multimodal.py.)"""

from __future__ import annotations

from types import ModuleType

from .. import forwards, third_party
from ..families import ModelFamily
from ..patching import switch


def patch(family: ModelFamily, module: ModuleType) -> None:
    """Switch the module's rope functions the family lists."""
    if family.rope and hasattr(module, "apply_rotary_pos_emb"):  # 4.57's Qwen2(.5)-VL: multimodal rope only
        switch(module, "apply_rotary_pos_emb", "rope", forwards.rope_function)
    for _, function in family.mrope_attention:
        switch(module, function, "rope", third_party.mrope_function(getattr(module, function)))
