"""Data utilities for training: FlatteningCollator (HF's DataCollatorWithFlattening contract plus the Qwen-VL
vision inputs and the Omni audio clips), pad_audio_clips. Sits beside trainers/: imports nothing from trainers or
cli."""

from .flattening import FlatteningCollator, pad_audio_clips

__all__ = ["FlatteningCollator", "pad_audio_clips"]
