"""Functional kernels, one file per op, each holding its torch / npu / cuda implementations.

Importing the package registers every op, so the registry (and `mindspeed-hf env`, `report()`) is complete.
"""

# The module (not its function) keeps this name: `import mindspeed_hf.ops.fused_linear_cross_entropy` must work.
from . import (  # noqa: F401  (register their ops)
    dit_attention,
    dit_rms_norm,
    dit_rope,
    experts,
    fused_linear_cross_entropy,
    linear,
    linear_attention,
    vision_attention,
)
from .attention import ATTENTION_NAME, attention_forward, register_attention, unregister_attention
from .registry import BACKEND_CHOICES, implementation, registered_ops, resolve_backend, select, set_backend
from .rms_norm import rms_norm
from .rotary import apply_rotary_pos_emb
from .swiglu import swiglu, swiglu_packed

__all__ = [
    "ATTENTION_NAME",
    "BACKEND_CHOICES",
    "apply_rotary_pos_emb",
    "attention_forward",
    "implementation",
    "registered_ops",
    "register_attention",
    "resolve_backend",
    "rms_norm",
    "select",
    "set_backend",
    "swiglu",
    "swiglu_packed",
    "unregister_attention",
]
