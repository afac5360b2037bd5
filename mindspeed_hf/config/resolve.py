"""The one precedence of the settings' layers (sources.py), highest first:

    explicit arguments  >  MINDSPEED_HF_* variables  >  YAML file  >  accelerate launch environment  >  defaults

Explicit arguments are what a trainer was given (set mindspeed_* fields, TrainingArguments `fsdp_config` /
`parallelism_config`); a config given to enable() takes the place of the layers below them. Two explicit sources
that disagree are an error; a lower layer overridden by a higher one is an Override, logged once by whoever owns the
result: a trainer when it is set up (`ResolvedConfig.log_overrides`), `resolve()` itself for a process-level call.

Resolving is a pure function of the layers, so one set of layers is resolved once (a MindSpeedTrainingArguments
validated at construction and the trainer given it share the work); each caller gets its own copy of the result.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .schema import MindSpeedConfig, build
from .sources import Layer, accelerator_layer, process_layers, run_file_layers, trainer_layers

logger = logging.getLogger("mindspeed_hf")


@dataclass(frozen=True)
class Override:
    """A setting a higher layer gave over what a lower one said."""

    path: str
    value: Any
    source: str
    replaced: Any
    replaced_source: str

    def log(self) -> None:
        logger.info("mindspeed_hf: %s=%r from the %s overrides %r from the %s", self.path, self.value, self.source,
                    self.replaced, self.replaced_source)


@dataclass
class ResolvedConfig:
    """A config plus where each setting that is not a default came from."""

    config: MindSpeedConfig
    sources: dict[str, str]  # setting path -> layer source
    names: dict[str, str] = field(default_factory=dict)  # setting path -> how that source spells it
    overrides: tuple[Override, ...] = ()

    def is_set(self, path: str) -> bool:
        return path in self.sources

    def value(self, path: str) -> Any:
        section, _, key = path.rpartition(".")
        return getattr(getattr(self.config, section) if section else self.config, key)

    def describe(self, path: str) -> str:
        """`mindspeed_dp_shard=4 (training arguments (mindspeed_*))`: the setting as its source spelled it."""
        return f"{self.names.get(path, path)}={self.value(path)!r} ({self.sources.get(path, 'default')})"

    def log_overrides(self) -> None:
        """One info line per setting a higher layer took from a lower one."""
        for override in self.overrides:
            override.log()


def _merge(lower: list[Layer], explicit: list[Layer], fallback: list[Layer]) -> ResolvedConfig:
    """`lower` layers (lowest first), then the `explicit` ones (all of the top rank: two that disagree are an
    error naming both), then the `fallback` ones (HF's own switches that mean one of our settings), which fill a
    setting only where no other source set it (an explicit `memory.recompute: false` keeps ours off)."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    names: dict[str, str] = {}
    overrides: list[Override] = []
    chosen: set[str] = set()
    for rank, layer in [(0, layer) for layer in lower] + [(1, layer) for layer in explicit]:
        for path, value in layer.values.items():
            if rank and path in chosen and values[path] != value:
                raise ValueError(f"{sources[path]} sets {path}={values[path]!r} but {layer.source} sets "
                                 f"{value!r}; set it in one place only")
            if path in values and values[path] != value:
                overrides.append(Override(path, value, layer.source, values[path], sources[path]))
            values[path], sources[path] = value, layer.source
            names[path] = layer.names.get(path, path)
            if rank:
                chosen.add(path)
    for layer in fallback:
        for path, value in layer.values.items():
            if path not in values:  # a source that set it, even to its default, wins
                values[path], sources[path], names[path] = value, layer.source, layer.names.get(path, path)
    return ResolvedConfig(build(values), sources, names, tuple(overrides))


_RESOLVED: dict[str, ResolvedConfig] = {}  # the last few resolutions, by their layers
_KEEP = 8


def resolve_layers(lower: list[Layer], explicit: list[Layer] | None = None,
                   fallback: list[Layer] | None = None) -> ResolvedConfig:
    """The config the layers give (see `_merge`), without logging; the same layers are resolved once (the key is
    their repr, not their equality: True == 1 and 2.0 == 2 must not meet). A failure is not kept."""
    key = repr((lower, explicit, fallback))
    if key not in _RESOLVED:
        _RESOLVED[key] = _merge(lower, explicit or [], fallback or [])
        for old in list(_RESOLVED)[:-_KEEP]:
            del _RESOLVED[old]
    return copy.deepcopy(_RESOLVED[key])


def resolve(explicit: list[Layer] | None = None, *, yaml_source: Any = None, env: Mapping[str, str] | None = None,
            base: MindSpeedConfig | None = None, fallback: list[Layer] | None = None) -> ResolvedConfig:
    """Resolve the layers: explicit > MINDSPEED_HF_* environment > YAML > accelerate environment > defaults, and
    log what overrides what.

    `explicit` layers are all of the top rank: if two of them set one setting to different values, that is an
    error naming both. `base` (a whole config, e.g. the one given to enable()) takes the place of the layers below
    the explicit ones. `fallback` layers (HF's own switches that mean one of our settings, such as
    TrainingArguments' gradient_checkpointing) fill a setting only where no other source set it.
    Raises ValueError for unknown keys, bad values and contradictions.
    """
    resolved = resolve_layers(process_layers(yaml_source, env, base), explicit, fallback)
    resolved.log_overrides()
    return resolved


def resolve_for(args: Any, base: MindSpeedConfig | None = None) -> ResolvedConfig:
    """The config of a trainer given `args` (TrainingArguments, or None): its own layers as explicit ones over
    `base` (a config given to enable()) or else the environment / YAML / defaults; the settings of a run file the
    arguments were built from (`mindspeed-hf train RUN.yaml`) sit just below the arguments, the command's own
    defaults below every source. Not logged: the trainer logs its overrides once (`log_overrides`)."""
    explicit, fallback = trainer_layers(args)
    below, above = run_file_layers(args) if args is not None else ([], [])
    return resolve_layers(below + process_layers(base=base) + above, explicit, fallback)


def resolve_for_accelerator(fsdp_plugin: Any = None, parallelism_config: Any = None,
                            base: MindSpeedConfig | None = None) -> ResolvedConfig:
    """The config of an accelerate loop's Accelerator: the `fsdp_plugin` / `parallelism_config` the script gave it
    as the explicit layer over `base` or the environment / YAML / defaults, as for a trainer. Not logged: the
    accelerator's run logs its overrides once."""
    return resolve_layers(process_layers(base=base), [accelerator_layer(fsdp_plugin, parallelism_config)])


def load_config(source: str | os.PathLike | Mapping[str, Any] | None = None) -> MindSpeedConfig:
    """The config from a dict or a file (then that is the YAML layer); with no source, from MINDSPEED_HF_CONFIG.
    The MINDSPEED_HF_* variables and the accelerate launch environment are layered as `resolve` describes."""
    return resolve(yaml_source=source).config
