"""Memory features, one setting each."""

from .recompute import enable_recompute

__all__ = ["enable_recompute"]
