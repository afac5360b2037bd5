"""Snapshots of what enable() may change in transformers, to show that disable() (or a failed enable()) puts every
symbol back: shared by tests/trainer/test_seams.py and the distributed disable worker."""

from __future__ import annotations


def transformers_symbols() -> dict[str, object]:
    """Every attribute of transformers' model modules and of their classes, Trainer and TrainingArguments, and the
    names in the attention / mask / experts registries: what enable() may change (the families' modules are
    imported first, so that importing them is not counted as a change)."""
    import sys

    from mindspeed_hf.patches import apply
    from mindspeed_hf.patches.families import FAMILIES

    for family in FAMILIES.values():
        apply._modeling(family)

    from transformers import AttentionInterface, Trainer, TrainingArguments
    from transformers.masking_utils import AttentionMaskInterface

    found: dict[str, object] = {}
    modules = [m for name, m in list(sys.modules.items()) if name.startswith("transformers.models.") and m]
    for module in modules:
        for name, value in list(vars(module).items()):
            found[f"{module.__name__}.{name}"] = value
            if isinstance(value, type) and value.__module__ == module.__name__:
                found.update({f"{module.__name__}.{name}.{k}": v for k, v in vars(value).items()})
    for cls in (Trainer, TrainingArguments):
        found.update({f"{cls.__name__}.{k}": v for k, v in vars(cls).items()})
    for interface in (AttentionInterface, AttentionMaskInterface):
        found[interface.__name__] = tuple(sorted(interface._global_mapping))
    from mindspeed_hf.releases import compat

    experts = compat.experts_registry()
    if experts is not None:
        found["experts"] = tuple(sorted(experts.functions._global_mapping))
    return found


def changed(before: dict, after: dict) -> list[str]:
    """The names whose value differs between two transformers_symbols() snapshots, less transformers' own memo
    caches (``*_cached_value``: set on a class the first time anyone switches its attention implementation)."""
    return sorted(k for k in before.keys() | after.keys() if not k.endswith("_cached_value")
                  and before.get(k, None) is not after.get(k, None)
                  and before.get(k) != after.get(k))
