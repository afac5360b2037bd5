"""Memory features, one setting each: recompute (full or selective)."""

from .recompute import apply_recompute_config, enable_recompute, remove_recompute

__all__ = ["apply_recompute_config", "enable_recompute", "remove_recompute"]
