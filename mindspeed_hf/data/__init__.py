"""Data utilities for training: FlatteningCollator (HF's DataCollatorWithFlattening contract plus the Qwen-VL
vision inputs). Sits beside trainers/: imports nothing from trainers or cli."""

from .flattening import FlatteningCollator

__all__ = ["FlatteningCollator"]
