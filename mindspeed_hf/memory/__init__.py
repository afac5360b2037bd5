"""Memory features, one setting each: recompute (full or selective) and asynchronous activation offload."""

from ..lazy_exports import lazy_exports

#: public name -> the module of this package that defines it (offload loads when a run asks for it)
_EXPORTS: dict[str, str] = {
    "apply_offload_config": "offload_model",
    "is_offload_layer": "offload_model",
    "offloader_of": "offload_model",
    "remove_offload": "offload_model",
    "apply_recompute_config": "recompute",
    "enable_recompute": "recompute",
    "remove_recompute": "recompute",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
