"""Public names of a package imported from their modules on first use (PEP 562), so `import mindspeed_hf` loads
what a run applies, not every optional step (docs/host_time.md: what the import costs)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def public_names(modules: dict[str, tuple[str, ...]]) -> list[str]:
    """Every name of `modules` ({submodule: its public names}), sorted: a lazy package's `__all__`."""
    return sorted(name for names in modules.values() for name in names)


def lazy_exports(package: str, modules: dict[str, tuple[str, ...]]) -> tuple[Callable[[str], Any],
                                                                          Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package`, whose public names `modules` lists per submodule
    ({"fsdp": ("apply_fsdp", ...)}); a name is imported from its submodule when first read, then kept."""
    exports = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        vars(sys.modules[package])[name] = value  # resolved once
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
