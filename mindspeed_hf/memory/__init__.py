"""Memory features, one setting each: recompute (full or selective) and asynchronous activation offload."""

from .offload_model import apply_offload_config, is_offload_layer, offloader_of, remove_offload
from .recompute import apply_recompute_config, enable_recompute, remove_recompute

__all__ = ["apply_offload_config", "apply_recompute_config", "enable_recompute", "is_offload_layer", "offloader_of",
           "remove_offload", "remove_recompute"]
