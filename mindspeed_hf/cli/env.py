"""`mindspeed-hf env`: the environment as a markdown table to paste into a bug report: device, versions, and
which implementation every op would use here, and why."""

from __future__ import annotations

import importlib
import os
import pkgutil
import platform
import sys
from importlib import metadata
from pathlib import Path

import torch

from ..releases import supported

PACKAGES = ("torch", "torch_npu", "transformers", "accelerate", "peft", "trl", "liger-kernel", "datasets",
            "tokenizers", "safetensors", "bitsandbytes")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def cann_version() -> str:
    """The CANN toolkit version from ASCEND_TOOLKIT_HOME (or the default install path), if present."""
    home = os.environ.get("ASCEND_TOOLKIT_HOME") or "/usr/local/Ascend/ascend-toolkit/latest"
    root = Path(home)
    if not root.is_dir():
        return "not found"
    # Toolkit installs record the version in <arch>-linux/ascend_toolkit_install.info or version.cfg.
    for info in [*sorted(root.glob("*-linux/ascend_toolkit_install.info")), root / "version.cfg"]:
        if info.is_file():
            for line in info.read_text(errors="replace").splitlines():
                key, _, value = line.partition("=")
                if key.strip() in ("version", "toolkit_installed_version") and value.strip():
                    return f"{value.strip()} ({root})"
    return f"unknown version ({root})"


def device_rows() -> list[tuple[str, str]]:
    """(setting, value) rows describing the accelerator of this process."""
    from ..device import detect_device_type, device_module, import_torch_npu

    device = detect_device_type()
    rows = [("device", device)]
    module = device_module(device)
    if module is not None:
        rows.append(("device count", str(module.device_count())))
        rows.append(("device name", str(module.get_device_name(0))))
    else:
        rows.append(("CPU", f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                            f"torch threads {torch.get_num_threads()}"))
    if device != "npu":
        npu = "torch_npu importable, no NPU visible" if import_torch_npu() is not None else "none (no torch_npu)"
        rows.append(("NPU", npu))
    return rows


def _load_all_ops() -> None:
    # Each op registers its kernels when its module is imported: import every module of mindspeed_hf.ops.
    from .. import ops

    for info in pkgutil.iter_modules(ops.__path__):
        importlib.import_module(f"{ops.__name__}.{info.name}")


def _why(requested: str, backend: str, kernel_backend: str, device: str) -> str:
    from ..device import import_torch_npu
    from ..ops.registry import liger_available

    source = f"MINDSPEED_HF_BACKEND={requested}" if requested != "auto" else f"auto: tensors on {device}"
    if kernel_backend == backend:
        return f"{source} -> {backend}"
    if backend == "npu" and import_torch_npu() is None:
        reason = "torch_npu not importable"
    elif backend == "cuda" and not liger_available():
        reason = "liger-kernel/triton not importable"
    else:
        reason = f"no {backend} kernel for this op"
    return f"{source} -> {backend}, but {reason}: falls back to {kernel_backend}"


def op_rows() -> list[tuple[str, str, str]]:
    """(op, implementation, why) for every registered op on this process's device."""
    from ..device import detect_device_type
    from ..ops import registry

    _load_all_ops()
    device = detect_device_type()
    try:
        requested = registry.requested_backend()
    except ValueError as err:  # a bad MINDSPEED_HF_BACKEND: say so in the table instead of crashing
        return [("(all)", "error", str(err))]
    backend = registry.resolve_backend(device)
    rows = []
    for op in registry.registered_ops():
        kernel = registry.select(op, device)
        rows.append((op, kernel.name, _why(requested, backend, kernel.backend, device)))
    return rows


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def env_report() -> str:
    """The whole report as markdown."""
    import mindspeed_hf

    try:
        backend = mindspeed_hf.get_config().backend
    except ValueError as err:  # a bad setting: say which, and report the rest
        backend = f"(invalid config: {err})"
    settings = [
        ("mindspeed_hf", f"{mindspeed_hf.__version__} ({Path(mindspeed_hf.__file__).parent})"),
        ("enabled", f"{mindspeed_hf.is_enabled()} (MINDSPEED_HF_AUTO={os.environ.get('MINDSPEED_HF_AUTO', 'unset')})"),
        ("MINDSPEED_HF_BACKEND", os.environ.get("MINDSPEED_HF_BACKEND", "unset")),
        ("MINDSPEED_HF_CONFIG", os.environ.get("MINDSPEED_HF_CONFIG", "unset")),
        ("config backend", backend),
        ("supported", supported.describe()),
        ("python", sys.version.split()[0]),
        ("platform", platform.platform()),
        *device_rows(),
        ("CANN", cann_version()),
        *((name, _version(name)) for name in PACKAGES),
    ]
    return "\n\n".join([
        "## mindspeed_hf environment",
        _table(("setting", "value"), settings),
        "## Settings that are not defaults (precedence: arguments > MINDSPEED_HF_* > YAML > accelerate env)",
        _table(("setting", "value", "from"), setting_rows()),
        "## Kernels on this device",
        _table(("op", "implementation", "why"), op_rows()),
    ])


def setting_rows() -> list[tuple[str, str, str]]:
    """Each setting the environment / YAML / accelerate launch sets for this process, and where it came from."""
    from ..config import resolve

    try:
        resolved = resolve()
    except ValueError as err:  # a bad MINDSPEED_HF_* / accelerate variable: the report says which, then goes on
        return [("(invalid)", str(err), "fix this before training")]
    return [(path, repr(resolved.value(path)), f"{resolved.names[path]} ({resolved.sources[path]})")
            for path in resolved.sources] or [("(none)", "", "all defaults")]


def main() -> int:
    """Print the environment report."""
    print(env_report())
    return 0
