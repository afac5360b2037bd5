"""Functional kernels, one file per op, each holding its torch / npu / cuda implementations."""

from .registry import BACKEND_CHOICES, implementation, registered_ops, resolve_backend, select, set_backend
from .rms_norm import rms_norm
from .rotary import apply_rotary_pos_emb
from .swiglu import swiglu, swiglu_packed

__all__ = [
    "BACKEND_CHOICES",
    "apply_rotary_pos_emb",
    "implementation",
    "registered_ops",
    "resolve_backend",
    "rms_norm",
    "select",
    "set_backend",
    "swiglu",
    "swiglu_packed",
]
