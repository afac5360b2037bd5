"""One typed configuration for the accelerator: kernels, parallel sizes, memory features.

It is read from a YAML/JSON file or a dict (`MINDSPEED_HF_CONFIG=path.yaml` for unmodified scripts), and from
MindSpeedTrainingArguments. Unknown keys and bad values fail here, before any model is built, with a message
that names the setting and the valid choices.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .ops.registry import BACKEND_CHOICES


@dataclass
class KernelConfig:
    """Which fused kernels to apply. Each one can be switched off on its own."""

    rms_norm: bool = True
    rope: bool = True
    swiglu: bool = True
    attention: bool = True
    fused_linear_cross_entropy: bool = True
    # Tokens per chunk of the fused loss; 0 picks one from the vocabulary size (see ops/fused_linear_cross_entropy).
    loss_chunk_size: int = 0

    def __post_init__(self) -> None:
        if self.loss_chunk_size < 0:
            raise ValueError(f"kernels.loss_chunk_size={self.loss_chunk_size} must be >= 0 (0 = automatic)")


@dataclass
class ParallelConfig:
    """Device-mesh sizes. dp_shard=-1 takes what the other sizes leave of the world size."""

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    ep: int = 1
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    prefetch: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name}={getattr(self, name)} must be >= 1")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ValueError(f"parallel.dp_shard={self.dp_shard} must be >= 1, or -1 to fill the world size")
        if self.prefetch < 0:
            raise ValueError(f"parallel.prefetch={self.prefetch} must be >= 0")


@dataclass
class MemoryConfig:
    """Memory features, one switch each."""

    recompute: bool = False


@dataclass
class MindSpeedConfig:
    """The whole accelerator configuration."""

    backend: str = "auto"
    kernels: KernelConfig = field(default_factory=KernelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_CHOICES:
            raise ValueError(f"backend={self.backend!r} is not valid; choose one of {', '.join(BACKEND_CHOICES)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTIONS = {"kernels": KernelConfig, "parallel": ParallelConfig, "memory": MemoryConfig}


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _check_type(where: str, value: Any, expected: Any) -> Any:
    expected = {"bool": bool, "int": int, "str": str}.get(expected, expected)
    if expected is bool and not isinstance(value, bool):
        raise ValueError(f"{where}={value!r} must be true or false")
    if expected is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{where}={value!r} must be an integer")
    if expected is str and not isinstance(value, str):
        raise ValueError(f"{where}={value!r} must be a string")
    return value


def _build_section(name: str, cls: type, values: Any) -> Any:
    if not isinstance(values, dict):
        raise ValueError(f"config section {name!r} must be a mapping of {', '.join(_field_names(cls))}")
    valid = {f.name: f.type for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(f'{name}.{k}' for k in unknown)}; valid keys: {', '.join(valid)}")
    return cls(**{k: _check_type(f"{name}.{k}", v, valid[k]) for k, v in values.items()})


def config_from_dict(data: dict[str, Any] | None) -> MindSpeedConfig:
    """Build and validate a MindSpeedConfig from nested dicts ({backend, kernels: {...}, parallel, memory})."""
    data = dict(data or {})
    valid = ["backend", *_SECTIONS]
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ValueError(f"unknown config key(s) {', '.join(unknown)}; valid keys: {', '.join(valid)}")
    sections = {name: _build_section(name, cls, data.get(name, {})) for name, cls in _SECTIONS.items()}
    return MindSpeedConfig(backend=_check_type("backend", data.get("backend", "auto"), str), **sections)


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML or JSON file into a dict, with a clear error when it is missing or not a mapping."""
    import yaml  # JSON is a subset of YAML

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"config file {str(file)!r} does not exist")
    data = yaml.safe_load(file.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(file)!r} must hold a mapping at the top level")
    return data


def load_config(source: str | os.PathLike | dict[str, Any] | None = None) -> MindSpeedConfig:
    """The config from a dict or a file; with no source, from MINDSPEED_HF_CONFIG (or the defaults).

    MINDSPEED_HF_BACKEND, when set, overrides the backend in every case.
    """
    if source is None:
        source = os.environ.get("MINDSPEED_HF_CONFIG") or None
    data = source if isinstance(source, dict) or source is None else read_config_file(source)
    config = config_from_dict(data)
    env_backend = os.environ.get("MINDSPEED_HF_BACKEND")
    if env_backend:
        config.backend = env_backend.lower()
        config.__post_init__()
    return config
