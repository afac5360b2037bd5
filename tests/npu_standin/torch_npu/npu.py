"""torch_npu.npu: only what the project calls on it without a device (set_compile_mode)."""

from __future__ import annotations


def set_compile_mode(jit_compile=True):
    """No-op on the CPU stand-in (the device setting for online op compilation)."""
    if not isinstance(jit_compile, bool):
        raise TypeError(f"set_compile_mode(): jit_compile must be bool, not {type(jit_compile).__name__}")
