"""How the kernels reach Hugging Face models: the patch engine and one declarative entry per model family."""

from .apply import ATTENTION_NAME, active_config, apply_to_model, disable, enable, find_hf_model, is_enabled, report
from .families import FAMILIES, ModelFamily

__all__ = [
    "ATTENTION_NAME",
    "FAMILIES",
    "ModelFamily",
    "active_config",
    "apply_to_model",
    "disable",
    "enable",
    "find_hf_model",
    "is_enabled",
    "report",
]
