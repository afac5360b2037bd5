"""The releases of the Hugging Face stack this version of mindspeed_hf supports (the same ranges as setup.cfg;
CI runs the test suite at both ends: .ci/oldest.txt pins the old end).

Read without importing the packages (an imported package's `__version__`, else its installed metadata), so the
check is cheap and runs before any of our patching: outside the range `import mindspeed_hf` warns once and leaves
everything unaccelerated.
"""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.version import Version

#: package -> (lowest supported release, first release not supported)
SUPPORTED: dict[str, tuple[str, str]] = {
    "transformers": ("4.57", "6"),
    "accelerate": ("1.10", "2"),
    "peft": ("0.17", "1"),
}


def installed(package: str) -> Version | None:
    """The installed release of `package`, None where it is not installed. An imported package's `__version__` (the
    metadata's string for transformers, accelerate and peft, checked at both tested ends) spares parsing its
    metadata file (~1.5 ms each, at every `import mindspeed_hf`)."""
    version = getattr(sys.modules.get(package), "__version__", None)
    if isinstance(version, str):
        return Version(version)
    try:
        return Version(metadata.version(package))
    except metadata.PackageNotFoundError:
        return None


def unsupported() -> list[str]:
    """One phrase per installed package outside its supported range (peft may be absent)."""
    out = []
    for package, (low, high) in SUPPORTED.items():
        version = installed(package)
        if version is not None and not Version(low) <= version < Version(high):
            out.append(f"{package} {version} (supported: >={low},<{high})")
    return out


def describe() -> str:
    """`transformers >=4.57,<6, accelerate >=1.10,<2, peft >=0.17,<1`."""
    return ", ".join(f"{package} >={low},<{high}" for package, (low, high) in SUPPORTED.items())


#: expert parallelism needs the fused 3-D experts modules (gate_up_proj [E, 2I, H]) transformers 5 introduced
EP_MIN_TRANSFORMERS = "5.0"


def check_ep_release(ep: int) -> None:
    """Refuse parallel.ep > 1 on a transformers release without fused experts modules."""
    found = installed("transformers")
    if found is not None and found < Version(EP_MIN_TRANSFORMERS):
        raise ValueError(f"parallel.ep={ep}: expert parallelism needs transformers >= {EP_MIN_TRANSFORMERS} (fused "
                         f"experts modules), transformers {found} is installed; valid choices: parallel.ep=1")
