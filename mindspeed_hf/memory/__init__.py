"""Memory features, one setting each: recompute (full or selective) and asynchronous activation offload."""

from ..lazy_exports import lazy_exports, public_names

#: each module of this package -> its public names, imported on first use (offload when a run asks for it)
_MODULES: dict[str, tuple[str, ...]] = {
    "offload_model": ("apply_offload_config", "is_offload_layer", "offloader_of", "remove_offload"),
    "recompute": ("apply_recompute_config", "enable_recompute", "remove_recompute"),
}

__all__ = public_names(_MODULES)
__getattr__, __dir__ = lazy_exports(__name__, _MODULES)
