"""The accelerator's settings, declared once: one dataclass per group (kernels, parallel, memory).

Everything else is derived from these declarations: the YAML schema (`MINDSPEED_HF_CONFIG=path.yaml`, sections
`kernels` / `parallel` / `memory` plus `backend`), the training arguments (`mindspeed_<key>`, see
trainers/arguments.py) and the environment variables (`MINDSPEED_HF_<SECTION>_<KEY>`, `MINDSPEED_HF_BACKEND`).

A setting can be given in several places. They are read as layers, and the higher layer wins:

    explicit arguments  >  MINDSPEED_HF_* variables  >  YAML file  >  accelerate launch environment  >  defaults

(explicit arguments: what a trainer was given - MindSpeedTrainingArguments fields that were set, TrainingArguments
`fsdp_config` / `parallelism_config`, or a config passed to `enable()`). Two explicit sources that disagree are an
error; a lower layer overridden by a higher one is logged once. Unknown keys and bad values fail here, before any
model is built, naming the setting and the valid choices.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .value_kinds import (
    Kind,
    choice_list,
    choice_or_bool,
    flag,
    layer_selection,
    non_negative_int,
    parse_flag,
    unknown_names,
)

logger = logging.getLogger("mindspeed_hf")

# Kernel backends (ops.registry dispatches on them). Declared here, with the settings, so that reading a config
# imports no torch: `mindspeed-hf --help` and config errors stay fast.
BACKEND_CHOICES = ("auto", "torch", "npu", "cuda")

ENV_PREFIX = "MINDSPEED_HF_"

# What `mindspeed-hf train --recipe NAME` runs when no run YAML is given; the first is the default.
TRAIN_RECIPES = {
    "text": "the embedded text run (a tiny Qwen3 model learns list operations), or the run a CONFIG.yaml describes",
    "vl": "the embedded vision-language run: a tiny Qwen2.5-VL model learns to answer questions about synthetic "
          "images (the colour and the quadrant of a shape); needs transformers >= 5",
}


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass
class KernelConfig:
    """Which fused kernels to apply. Each one can be switched off on its own."""

    rms_norm: bool = field(default=True, metadata=_help("use the fused RMSNorm kernel"))
    rope: bool = field(default=True, metadata=_help("use the fused rotary position embedding kernel"))
    swiglu: bool = field(default=True, metadata=_help("use the fused SwiGLU MLP kernel"))
    attention: bool = field(default=True, metadata=_help(
        "make the fused attention kernel the default attention (an explicit attn_implementation is kept)"))
    fused_linear_cross_entropy: bool = field(default=True, metadata=_help(
        "chunked causal-LM loss that never holds the full [tokens, vocab] logits"))
    experts: bool = field(default=True, metadata=_help(
        "make the grouped-GEMM MoE experts kernel the default experts implementation (transformers >= 5; an "
        "explicit experts_implementation is kept)"))
    loss_chunk_size: int = field(default=0, metadata=_help(
        "tokens per chunk of the fused loss; 0 picks one from the vocabulary size"))
    skip_logits: str = field(default="auto", metadata=_help(
        "when the fused loss skips the logits: auto (only where nothing reads them: Trainer's own loss "
        "computation), always (every training forward with labels; reading .logits then raises), never",
        choices=["auto", "always", "never"]))

    def __post_init__(self) -> None:
        if self.loss_chunk_size < 0:
            raise ValueError(f"kernels.loss_chunk_size={self.loss_chunk_size} must be >= 0 (0 = automatic)")
        if self.skip_logits not in ("auto", "always", "never"):
            raise ValueError(f"kernels.skip_logits={self.skip_logits!r} is not valid; choose one of auto, always, "
                             "never")


@dataclass
class ParallelConfig:
    """Device-mesh sizes and FSDP2 knobs. dp_shard=-1 takes what the other sizes leave of the world size."""

    dp_replicate: int = field(default=1, metadata=_help("data-parallel replicas (HSDP outer dimension)"))
    dp_shard: int = field(default=-1, metadata=_help(
        "FSDP2 shard group size; -1 takes what the other sizes leave of the world size"))
    cp: int = field(default=1, metadata=_help(
        "context-parallel size: each sequence is split across cp ranks (which also shard the parameters with "
        "dp_shard); cp = ring size x cp_ulysses"))
    ep: int = field(default=1, metadata=_help(
        "expert-parallel size for MoE models with fused experts (transformers >= 5): each expert lives on one of ep "
        "ranks, borrowed from dp_shard * cp (must divide it and the number of experts)"))
    cp_ulysses: int = field(default=1, metadata=_help(
        "Ulysses (all-to-all heads <-> sequence) ranks inside the cp group; the rest (cp / cp_ulysses) form the "
        "ring; must divide cp and the attention heads"))
    cp_zigzag: bool = field(default=True, metadata=_help(
        "context parallelism cuts each ring rank's share into two chunks (head and tail) that balance causal work"))
    reshard_after_forward: bool = field(default=True, metadata=_help(
        "FSDP2 frees the gathered parameters of a layer after its forward"))
    cpu_offload: bool = field(default=False, metadata=_help("FSDP2 keeps sharded parameters in host memory"))
    prefetch: int = field(default=1, metadata=_help("FSDP2 layers whose parameters are gathered ahead"))

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "cp", "cp_ulysses", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name}={getattr(self, name)} must be >= 1")
        if self.cp % self.cp_ulysses:
            raise ValueError(f"parallel.cp_ulysses={self.cp_ulysses} must divide parallel.cp={self.cp}; valid "
                             f"choices: {[u for u in range(1, self.cp + 1) if self.cp % u == 0]}")
        if self.ep > 1:
            check_ep_release(self.ep)
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ValueError(f"parallel.dp_shard={self.dp_shard} must be >= 1, or -1 to fill the world size")
        if self.prefetch < 0:
            raise ValueError(f"parallel.prefetch={self.prefetch} must be >= 0")


#: expert parallelism needs the fused 3-D experts modules (gate_up_proj [E, 2I, H]) transformers 5 introduced
EP_MIN_TRANSFORMERS = "5.0"


def check_ep_release(ep: int) -> None:
    from packaging.version import Version

    from .versions import installed

    found = installed("transformers")
    if found is not None and found < Version(EP_MIN_TRANSFORMERS):
        raise ValueError(f"parallel.ep={ep}: expert parallelism needs transformers >= {EP_MIN_TRANSFORMERS} (fused "
                         f"experts modules), transformers {found} is installed; valid choices: parallel.ep=1")


RECOMPUTE_MODULES = ("attention_core", "self_attn", "mlp", "norms")


@dataclass
class MemoryConfig:
    """Memory features, one switch each. `recompute` holds False (off), True (full; `full` reads back as True,
    which it has always meant) or "selective"; `recompute_mode` names the three."""

    recompute: bool | str = field(default=False, metadata=_help(
        "recompute activations in backward (non-reentrant activation checkpointing): false; full (whole decoder "
        "layers; true means full); selective (only the parts of each layer in recompute_modules)",
        kind=choice_or_bool(("full", "selective"), true_means="full")))
    recompute_modules: list[str] = field(default_factory=lambda: ["attention_core", "mlp"], metadata=_help(
        "what selective recompute reruns in each chosen decoder layer: attention_core (self-attention except its "
        "projection matmuls, whose outputs are kept), self_attn (the whole self-attention), mlp (the MLP or MoE "
        "block), norms (the layer's RMSNorms)", kind=choice_list(RECOMPUTE_MODULES)))
    recompute_layers: str | int | list[int] = field(default="all", metadata=_help(
        "which decoder layers recompute (full or selective): all, n (every n-th: 0, n, 2n, ...) or a list of "
        "layer indices ([0, 2, 5]; as text 0,2,5)", kind=layer_selection()))
    offload_activations: bool = field(default=False, metadata=_help(
        "asynchronous activation offload: what each chosen decoder layer saves for backward (with recompute on, "
        "its recompute inputs) is copied to host memory on a side stream and its device memory freed once the "
        "next layer starts; backward brings it back one layer ahead. The last decoder layer is always kept",
        kind=flag()))
    offload_layers: str | int | list[int] = field(default="all", metadata=_help(
        "which decoder layers offload: all, n (every n-th: 0, n, 2n, ...) or a list of layer indices (the last "
        "decoder layer is kept whatever this says)", kind=layer_selection()))
    offload_min_bytes: int = field(default=1 << 20, metadata=_help(
        "smallest saved tensor that is offloaded, in bytes; smaller ones stay on the device",
        kind=non_negative_int("bytes")))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.metadata["kind"].check(f"memory.{f.name}", getattr(self, f.name)))

    @property
    def recompute_mode(self) -> str:
        """"off", "full" or "selective"."""
        return "full" if self.recompute is True else (self.recompute or "off")


@dataclass
class MindSpeedConfig:
    """The whole accelerator configuration."""

    backend: str = field(default="auto", metadata=_help(
        "kernel backend: auto follows the tensors' device; torch, npu or cuda force one",
        choices=list(BACKEND_CHOICES)))
    kernels: KernelConfig = field(default_factory=KernelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_CHOICES:
            raise ValueError(f"backend={self.backend!r} is not valid; choose one of {', '.join(BACKEND_CHOICES)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {"kernels": KernelConfig, "parallel": ParallelConfig, "memory": MemoryConfig}


# ---------------------------------------------------------------------------------------------- the settings
@dataclass(frozen=True)
class Setting:
    """One declared setting: where it lives in the config and the names derived from it."""

    section: str | None  # None: top level (backend)
    key: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def parser_options(self) -> dict[str, Any]:
        """Extra argparse options of the flag (a Kind's `nargs` / `const`); empty for plain types."""
        return dict(self.type.parser_options) if isinstance(self.type, Kind) else {}

    @property
    def path(self) -> str:
        """`kernels.rope`, `backend`: the name used in messages and YAML."""
        return f"{self.section}.{self.key}" if self.section else self.key

    @property
    def argument(self) -> str:
        """The MindSpeedTrainingArguments field / command-line flag name."""
        return f"mindspeed_{self.key}"

    @property
    def env(self) -> str:
        """The environment variable that sets it."""
        return ENV_PREFIX + self.path.replace(".", "_").upper()


_TYPES = {"bool": bool, "int": int, "str": str}


def _setting(section: str | None, f: dataclasses.Field) -> Setting:
    choices = f.metadata.get("choices")
    kind = f.metadata.get("kind") or (_TYPES[f.type] if isinstance(f.type, str) else f.type)
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return Setting(section, f.name, kind, default, f.metadata["help"], tuple(choices) if choices else None)


def settings() -> Iterator[Setting]:
    """Every setting, in declaration order."""
    for f in dataclasses.fields(MindSpeedConfig):
        if f.name not in SECTIONS:
            yield _setting(None, f)
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            yield _setting(section, f)


_SETTINGS = {s.path: s for s in settings()}
assert len({s.argument for s in _SETTINGS.values()}) == len(_SETTINGS), "setting keys must be unique"


# ---------------------------------------------------------------------------------------------- validation
def _check_type(where: str, value: Any, expected: type | Kind) -> Any:
    if isinstance(expected, Kind):
        return expected.check(where, value)
    if expected is bool and not isinstance(value, bool):
        raise ValueError(f"{where}={value!r} must be true or false")
    if expected is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{where}={value!r} must be an integer")
    if expected is str and not isinstance(value, str):
        raise ValueError(f"{where}={value!r} must be a string")
    return value


def _check_keys(where: str, values: Any, valid: list[str]) -> dict[str, Any]:
    if not isinstance(values, Mapping):
        raise ValueError(f"config section {where!r} must be a mapping of {', '.join(valid)}")
    unknown = set(values) - set(valid)
    if unknown:
        prefix = f"{where}." if where else ""
        raise unknown_names("config key", (prefix + k for k in unknown), (prefix + k for k in valid))
    return dict(values)


def flatten(data: Mapping[str, Any] | None) -> dict[str, Any]:
    """Nested config dict ({backend, kernels: {...}, ...}) -> {"kernels.rope": value, ...}, keys checked."""
    data = _check_keys("", data or {}, ["backend", *SECTIONS])
    flat: dict[str, Any] = {}
    for name, values in data.items():
        if name in SECTIONS:
            values = _check_keys(name, values if values is not None else {},
                                 [f.name for f in dataclasses.fields(SECTIONS[name])])
            flat.update({f"{name}.{k}": v for k, v in values.items()})
        else:
            flat[name] = values
    return flat


def _build(flat: Mapping[str, Any]) -> MindSpeedConfig:
    values = {path: _check_type(path, v, _SETTINGS[path].type) for path, v in flat.items()}
    sections = {name: cls(**{k.split(".", 1)[1]: v for k, v in values.items() if k.startswith(name + ".")})
                for name, cls in SECTIONS.items()}
    config = MindSpeedConfig(backend=values.get("backend", "auto"), **sections)
    config.backend = config.backend.lower()
    config.__post_init__()
    return config


def config_from_dict(data: Mapping[str, Any] | None) -> MindSpeedConfig:
    """Build and validate a MindSpeedConfig from nested dicts ({backend, kernels: {...}, parallel, memory})."""
    return _build(flatten(data))


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML or JSON file into a dict, with a clear error when it is missing or not a mapping."""
    import yaml  # JSON is a subset of YAML

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"config file {str(file)!r} does not exist")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:  # one line with the file and the place, not PyYAML's traceback
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"config file {str(file)!r} is not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(file)!r} must hold a mapping at the top level")
    return data


# ---------------------------------------------------------------------------------------------- layers
@dataclass
class Layer:
    """Settings from one source: `values` maps setting paths (`parallel.dp_shard`) to values; `names` says how the
    source spells a setting (`mindspeed_dp_shard`, `MINDSPEED_HF_PARALLEL_DP_SHARD`), for messages."""

    source: str
    values: dict[str, Any]
    names: dict[str, str] = field(default_factory=dict)


def _parse_env_value(setting: Setting, text: str, name: str | None = None) -> Any:
    """A variable's text as the setting's type; errors name the variable (`name`, default the setting's own)."""
    name = name or setting.env
    if isinstance(setting.type, Kind):
        return setting.type.check(name, text)
    if setting.type is bool:
        return parse_flag(text, name)
    if setting.type is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name}={text!r} must be an integer") from None
    value = text.strip().lower() if setting.key == "backend" else text
    if setting.key == "backend" and value not in BACKEND_CHOICES:  # name the variable, not the config key
        raise ValueError(f"{name}={text!r} is not valid; choose one of {', '.join(BACKEND_CHOICES)}")
    return value


#: MINDSPEED_HF_* variables that are not settings of the config.
OTHER_VARIABLES = ("MINDSPEED_HF_AUTO", "MINDSPEED_HF_CONFIG", "MINDSPEED_HF_LOG_LEVEL")


def check_variables(env: Mapping[str, str]) -> None:
    """A MINDSPEED_HF_* variable nobody reads is a typo: refused, naming the nearest real one."""
    known = {s.env for s in _SETTINGS.values()} | set(OTHER_VARIABLES)
    unknown = [name for name in env if name.startswith(ENV_PREFIX) and name not in known]
    if unknown:
        raise unknown_names("variable", unknown, sorted(known))


def env_layer(env: Mapping[str, str] | None = None) -> Layer:
    """MINDSPEED_HF_<SECTION>_<KEY> (and MINDSPEED_HF_BACKEND) variables; an unknown MINDSPEED_HF_* is refused."""
    env = os.environ if env is None else env
    check_variables(env)
    found = [s for s in _SETTINGS.values() if env.get(s.env)]
    return Layer("environment (MINDSPEED_HF_*)", {s.path: _parse_env_value(s, env[s.env]) for s in found},
                 {s.path: s.env for s in found})


def yaml_layer(source: str | os.PathLike | Mapping[str, Any] | None = None,
               env: Mapping[str, str] | None = None) -> Layer:
    """A YAML/JSON file or dict; with no source, the file MINDSPEED_HF_CONFIG names (or nothing)."""
    env = os.environ if env is None else env
    if source is None:
        source = env.get(ENV_PREFIX + "CONFIG") or None
    if source is None:
        return Layer("config file", {})
    if isinstance(source, Mapping):
        return Layer("config dict", flatten(source))
    try:
        return Layer(f"config file {str(source)!r}", flatten(read_config_file(source)))
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None


# accelerate launch exports an accelerate YAML as these variables; the ones our settings mean too.
ACCELERATE_SOURCE = "accelerate launch environment"
_ACCELERATE_SIZES = {"parallel.dp_replicate": "PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
                     "parallel.dp_shard": "PARALLELISM_CONFIG_DP_SHARD_SIZE",
                     "parallel.cp": "PARALLELISM_CONFIG_CP_SIZE"}
_ACCELERATE_FSDP = {"parallel.reshard_after_forward": "FSDP_RESHARD_AFTER_FORWARD",
                    "parallel.cpu_offload": "FSDP_OFFLOAD_PARAMS",
                    "memory.recompute": "FSDP_ACTIVATION_CHECKPOINTING"}


def parse_reshard(value: Any, where: str) -> bool:
    """reshard_after_forward as accelerate takes it: a flag, or an FSDP1 sharding-strategy name (full_shard frees
    the gathered parameters after forward; shard_grad_op and no_shard keep them)."""
    strategy = {"full_shard": True, "shard_grad_op": False, "no_shard": False}.get(str(value).strip().lower())
    return strategy if strategy is not None else parse_flag(value, where)


def accelerate_env_layer(env: Mapping[str, str] | None = None) -> Layer:
    """What an `accelerate launch` config says about our settings (PARALLELISM_CONFIG_*_SIZE with
    ACCELERATE_USE_PARALLELISM_CONFIG, and FSDP_* for an FSDP version 2 config)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    names: dict[str, str] = {}
    sizes = env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() in ("1", "true")  # as accelerate reads them
    for path, name in _ACCELERATE_SIZES.items():
        if sizes and env.get(name):
            values[path], names[path] = _parse_env_value(_SETTINGS[path], env[name], name), name
    fsdp2 = env.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true") and env.get("FSDP_VERSION", "1") == "2"
    for path, name in _ACCELERATE_FSDP.items():
        if fsdp2 and env.get(name):
            parse = parse_reshard if path == "parallel.reshard_after_forward" else parse_flag
            values[path], names[path] = parse(env[name], name), name
    return Layer(ACCELERATE_SOURCE, values, names)


@dataclass
class ResolvedConfig:
    """A config plus where each setting that is not a default came from."""

    config: MindSpeedConfig
    sources: dict[str, str]  # setting path -> layer source
    names: dict[str, str] = field(default_factory=dict)  # setting path -> how that source spells it

    def is_set(self, path: str) -> bool:
        return path in self.sources

    def value(self, path: str) -> Any:
        section, _, key = path.rpartition(".")
        return getattr(getattr(self.config, section) if section else self.config, key)

    def describe(self, path: str) -> str:
        """`mindspeed_dp_shard=4 (training arguments (mindspeed_*))`: the setting as its source spelled it."""
        return f"{self.names.get(path, path)}={self.value(path)!r} ({self.sources.get(path, 'default')})"


def resolve(explicit: list[Layer] | None = None, *, yaml_source: Any = None, env: Mapping[str, str] | None = None,
            base: MindSpeedConfig | None = None, fallback: list[Layer] | None = None) -> ResolvedConfig:
    """Resolve the layers: explicit > MINDSPEED_HF_* environment > YAML > accelerate environment > defaults.

    `explicit` layers are all of the top rank: if two of them set one setting to different values, that is an
    error naming both. `base` (a whole config, e.g. the one given to enable()) takes the place of the layers below
    the explicit ones. `fallback` layers (HF's own switches that mean one of our settings, such as
    TrainingArguments' gradient_checkpointing) fill a setting only where every other source left it at its default.
    Raises ValueError for unknown keys, bad values and contradictions.
    """
    if base is not None:
        layers = [Layer("config given to mindspeed_hf.enable()", flatten(base.to_dict()))]
    else:
        layers = [accelerate_env_layer(env), yaml_layer(yaml_source, env), env_layer(env)]
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    names: dict[str, str] = {}
    chosen: set[str] = set()
    for rank, layer in [(0, layer) for layer in layers] + [(1, layer) for layer in explicit or []]:
        for path, value in layer.values.items():
            if rank and path in chosen and values[path] != value:
                raise ValueError(f"{sources[path]} sets {path}={values[path]!r} but {layer.source} sets "
                                 f"{value!r}; set it in one place only")
            if path in values and values[path] != value:
                logger.info("mindspeed_hf: %s=%r from the %s overrides %r from the %s", path, value, layer.source,
                            values[path], sources[path])
            values[path], sources[path] = value, layer.source
            names[path] = layer.names.get(path, path)
            if rank:
                chosen.add(path)
    for layer in fallback or []:
        for path, value in layer.values.items():
            if values.get(path, _SETTINGS[path].default) == _SETTINGS[path].default:
                values[path], sources[path], names[path] = value, layer.source, layer.names.get(path, path)
    return ResolvedConfig(_build(values), sources, names)


def load_config(source: str | os.PathLike | Mapping[str, Any] | None = None) -> MindSpeedConfig:
    """The config from a dict or a file (then that is the YAML layer); with no source, from MINDSPEED_HF_CONFIG.
    The MINDSPEED_HF_* variables and the accelerate launch environment are layered as `resolve` describes."""
    return resolve(yaml_source=source).config
