"""The YAML run description of `mindspeed-hf train`, in the spirit of MindSpeed-MM's run files.

Sections: `model` (a config to build from scratch, or a local model directory / hub id, plus the tokenizer), `data`
(JSONL prompt/completion files, max length, packing), `parallel`, `features`, `moe` and `checkpoints` (the
accelerator config: mindspeed_hf.config), `training` (any transformers.TrainingArguments key), `evaluation` (the
before/after quality check) and `runtime` (process settings). Everything is checked here, before any model is built:
unknown keys name the key and the valid ones, and missing files name the setting that points at them.

Relative paths are relative to the YAML file; `builtin:NAME` names a file shipped in recipes/default_run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import KernelConfig, MemoryConfig, MindSpeedConfig, ParallelConfig, config_from_dict, read_config_file
from ..config.sources import Layer, attach_run_file
from ..value_kinds import known_keys, parse_flag, unknown_names
from .default_run import DEFAULT_RUN_CONFIG, DEFAULT_RUN_DIR

BUILTIN = "builtin:"


@dataclass
class ModelSpec:
    """Which model to train: `config` (dict, or a path to config.json / a dir) builds it from scratch;
    `name_or_path` (a local directory, or a Hugging Face hub id) loads pretrained weights."""

    config: dict[str, Any] | str | None = None
    name_or_path: str | None = None
    tokenizer: str | None = None
    dtype: str = "float32"
    attn_implementation: str | None = None


@dataclass
class DataSpec:
    """JSONL files with prompt/completion fields; loss only on the completion."""

    train: str | None = None
    eval: str | None = None
    eval_fraction: float = 0.05  # held out of `train` when no `eval` file is given
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    max_length: int = 64
    packing: bool = False
    max_tokens_per_batch: int = 0  # the accelerator's data.max_tokens_per_batch (0: batches of rows)


@dataclass
class EvalSpec:
    """The before/after check: held-out loss, and exact match of greedy answers to `num_prompts` prompts."""

    enabled: bool = True
    num_prompts: int = 100
    max_new_tokens: int = 16


@dataclass
class RuntimeSpec:
    """Process settings. `cpu_threads`: torch threads when running on the CPU (None keeps torch's default);
    tiny models train faster on one thread than split across cores."""

    cpu_threads: int | None = None


@dataclass
class RunConfig:
    """A validated run description."""

    model: ModelSpec
    data: DataSpec
    mindspeed: MindSpeedConfig
    training: dict[str, Any] = field(default_factory=dict)
    evaluation: EvalSpec = field(default_factory=EvalSpec)
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    source: str = "<dict>"
    layer: Layer | None = None  # the accelerator settings the file states, as a layer of their own (run_file_layer)


SECTIONS = ("model", "data", "parallel", "features", "moe", "checkpoints", "training", "evaluation", "runtime")
# `features` is flat, MindSpeed-MM style: the backend, every kernel switch and every memory feature.
FEATURE_KEYS = ("backend", *(f.name for f in dataclasses.fields(KernelConfig)),
                *(f.name for f in dataclasses.fields(MemoryConfig)))


def split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """(CONFIG.yaml or None, the rest) of a `train` / `bench` command line: the run file is its first word when that
    is not an option. Taken by hand rather than as an argparse positional, which would take the value of an unknown
    option (the `5` of `--max_steps 5`) for it."""
    if argv and not argv[0].startswith("-"):
        return argv[0], argv[1:]
    return None, argv


def _check_keys(where: str, values: Any, valid: list[str] | tuple[str, ...]) -> dict[str, Any]:
    return {} if values is None else known_keys(where, values, valid)


def _spec(where: str, cls: type, values: Any) -> Any:
    return cls(**_check_keys(where, values, [f.name for f in dataclasses.fields(cls)]))


def resolve_path(value: str, base: Path) -> Path:
    """`builtin:NAME` -> the shipped default_run file; relative -> relative to the YAML file's directory."""
    if value.startswith(BUILTIN):
        return DEFAULT_RUN_DIR / value[len(BUILTIN):]
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def _existing(setting: str, value: str | None, base: Path, required: bool = True) -> str | None:
    if value is None:
        if required:
            raise ValueError(f"{setting} is required (a path)")
        return None
    path = resolve_path(str(value), base)
    if not path.exists():
        raise FileNotFoundError(f"{setting}: {str(path)!r} does not exist")
    return str(path)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, but at call time."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    return bool(constants.HF_HUB_OFFLINE) if value is None else parse_flag(value, "HF_HUB_OFFLINE")


def _hub_cache() -> str:
    """The hub cache directory (HF_HUB_CACHE, else HF_HOME/hub, else huggingface_hub's default), read now."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return constants.HF_HUB_CACHE


def _model_source(setting: str, value: str, base: Path) -> str:
    """A local directory (relative to the YAML file) or a Hugging Face hub id, as from_pretrained takes it: `org/name`,
    or any id already in the local cache. With HF_HUB_OFFLINE=1 it must be cached; online it is fetched when the
    model loads."""
    path = resolve_path(str(value), base)
    if path.exists() or str(value).startswith(BUILTIN):
        return _existing(setting, value, base)
    missing = FileNotFoundError(f"{setting}: {str(path)!r} does not exist (give a local model directory or a "
                                "Hugging Face hub id such as Qwen/Qwen3-0.6B)")
    if not _HUB_ID.fullmatch(str(value)):
        raise missing
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(str(value), "config.json" if setting == "model.name_or_path" else
                                    "tokenizer_config.json", cache_dir=_hub_cache())
    if isinstance(cached, str):
        return str(value)
    if "/" not in str(value):  # not cached and no owner: a local path that is not there, not a hub id
        raise missing
    if not _hub_offline():  # fetched (or refused, naming the setting) when the model loads
        return str(value)
    raise FileNotFoundError(f"{setting}: {value!r} is neither a local directory nor a model in the Hugging Face cache "
                            f"({_hub_cache()}) and HF_HUB_OFFLINE=1 forbids downloading it; download it first, set "
                            "HF_HOME to the cache that has it, or give a local directory")


def _scalar_type(hint: Any) -> type | None:
    """int / float / bool behind a TrainingArguments annotation (also inside Optional[...] / X | None)."""
    import typing

    options = typing.get_args(hint) or (hint,)
    scalars = [t for t in options if t in (bool, int, float)]
    return scalars[0] if len(scalars) == 1 and all(t in (bool, int, float, type(None)) for t in options) else None


def _typed_training_values(values: dict[str, Any]) -> dict[str, Any]:
    """The `training` section with numbers and booleans checked against TrainingArguments' types: a string where
    a number goes (YAML 1.1 reads `3e-3` as a string) is converted as the command line would; anything else that
    does not fit fails here, naming the field."""
    import typing

    from transformers import TrainingArguments

    hints = typing.get_type_hints(TrainingArguments)
    out = dict(values)
    for key, value in values.items():
        kind = _scalar_type(hints.get(key))
        if kind is None or value is None or (isinstance(value, kind) and not (kind is int and isinstance(value, bool))):
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            continue
        where = f"training.{key}"
        if kind is bool:
            out[key] = parse_flag(value, where)
            continue
        try:
            out[key] = kind(str(value).strip())
        except ValueError:
            raise ValueError(f"{where}={value!r} must be {'an integer' if kind is int else 'a number'}") from None
    return out


def training_keys() -> list[str]:
    """The TrainingArguments keys the `training` section accepts."""
    from transformers import TrainingArguments

    return [f.name for f in dataclasses.fields(TrainingArguments) if f.init]


def _validate_model(spec: ModelSpec, base: Path) -> ModelSpec:
    if (spec.config is None) == (spec.name_or_path is None):
        raise ValueError("model: give exactly one of model.config (build from scratch) or model.name_or_path "
                         "(a local model directory or a hub id)")
    if spec.name_or_path is not None:
        spec.name_or_path = _model_source("model.name_or_path", spec.name_or_path, base)
    if isinstance(spec.config, str):
        spec.config = _existing("model.config", spec.config, base)
    elif isinstance(spec.config, dict) and "model_type" not in spec.config:
        raise ValueError("model.config needs a model_type (e.g. qwen3, llama)")
    source = spec.tokenizer or spec.name_or_path
    if source is None:
        raise ValueError("model.tokenizer is required (a local tokenizer directory or a hub id)")
    spec.tokenizer = _model_source("model.tokenizer", source, base)
    if spec.dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"model.dtype={spec.dtype!r} is not valid; choose one of float32, bfloat16, float16")
    return spec


def _validate_data(spec: DataSpec, base: Path) -> DataSpec:
    spec.train = _existing("data.train", spec.train, base)
    spec.eval = _existing("data.eval", spec.eval, base, required=False)
    if spec.max_length < 2:
        raise ValueError(f"data.max_length={spec.max_length} must be >= 2")
    if not 0.0 <= spec.eval_fraction < 1.0:
        raise ValueError(f"data.eval_fraction={spec.eval_fraction} must be in [0, 1)")
    return spec


def _validate_runtime(spec: RuntimeSpec) -> RuntimeSpec:
    if spec.cpu_threads is not None and (not isinstance(spec.cpu_threads, int) or spec.cpu_threads < 1):
        raise ValueError(f"runtime.cpu_threads={spec.cpu_threads!r} must be a positive integer or null")
    return spec


def mindspeed_config_from_sections(parallel: Any, features: Any, checkpoints: Any = None,
                                   moe: Any = None, max_tokens_per_batch: int = 0) -> MindSpeedConfig:
    """Map the flat `features` section, the `parallel`, `moe` and `checkpoints` sections and the `data` section's
    max_tokens_per_batch onto one validated MindSpeedConfig."""
    features = _check_keys("features", features, FEATURE_KEYS)
    parallel = _check_keys("parallel", parallel, [f.name for f in dataclasses.fields(ParallelConfig)])
    kernel_keys = {f.name for f in dataclasses.fields(KernelConfig)}
    data: dict[str, Any] = {
        "kernels": {k: v for k, v in features.items() if k in kernel_keys},
        "memory": {k: v for k, v in features.items() if k not in kernel_keys and k != "backend"},
        "parallel": parallel,
        "checkpoints": checkpoints or {},
        "moe": moe or {},
        "data": {"max_tokens_per_batch": max_tokens_per_batch},
    }
    if "backend" in features:
        data["backend"] = features["backend"]
    return config_from_dict(data)


def run_file_layer(data: dict[str, Any], config: MindSpeedConfig, source: str) -> Layer:
    """The accelerator settings the run file states (its `parallel`, `features`, `moe` and `checkpoints` sections,
    data.max_tokens_per_batch), with their checked values, spelled as in the file: the run's own layer of the
    settings (mindspeed_hf.config), so a message names the run file and the key written there."""
    kernel_keys = {f.name for f in dataclasses.fields(KernelConfig)}
    spelled: dict[str, str] = {}
    for key in data.get("features") or {}:
        path = key if key == "backend" else f"{'kernels' if key in kernel_keys else 'memory'}.{key}"
        spelled[path] = f"features.{key}"
    for section in ("parallel", "moe", "checkpoints"):
        spelled.update({f"{section}.{key}": f"{section}.{key}" for key in data.get(section) or {}})
    if "max_tokens_per_batch" in (data.get("data") or {}):
        spelled["data.max_tokens_per_batch"] = "data.max_tokens_per_batch"

    def value(path: str) -> Any:
        section, _, key = path.rpartition(".")
        return getattr(getattr(config, section) if section else config, key)

    return Layer(f"run file {source!r}", {path: value(path) for path in spelled}, spelled)


def parse_run_config(data: dict[str, Any], base: Path, source: str = "<dict>") -> RunConfig:
    """Validate a run description given as a dict (paths relative to `base`)."""
    data = _check_keys("", data, SECTIONS)
    stray = sorted(k for k in (data.get("training") or {}) if str(k).startswith("mindspeed_"))
    if stray:
        raise ValueError(f"training.{stray[0]}: accelerator settings go in the `features` and `parallel` sections "
                         f"(features: {', '.join(FEATURE_KEYS)})")
    training = _typed_training_values(_check_keys("training", data.get("training"), training_keys()))
    spec = _validate_data(_spec("data", DataSpec, data.get("data")), base)
    mindspeed = mindspeed_config_from_sections(data.get("parallel"), data.get("features"), data.get("checkpoints"),
                                               data.get("moe"), spec.max_tokens_per_batch)
    return RunConfig(
        model=_validate_model(_spec("model", ModelSpec, data.get("model")), base),
        data=spec,
        mindspeed=mindspeed,
        training=training,
        evaluation=_spec("evaluation", EvalSpec, data.get("evaluation")),
        runtime=_validate_runtime(_spec("runtime", RuntimeSpec, data.get("runtime"))),
        source=source,
        layer=run_file_layer(data, mindspeed, source),
    )


def load_run_config(path: str | Path | None = None) -> RunConfig:
    """Read and validate a run YAML; with no path, the embedded default run."""
    file = Path(path) if path is not None else DEFAULT_RUN_CONFIG
    try:
        data = read_config_file(file)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"run config: {err}") from None
    try:
        return parse_run_config(data, file.resolve().parent, source=str(file))
    except (ValueError, FileNotFoundError) as err:
        raise type(err)(f"{file}: {err}") from None


#: `mindspeed-hf train` on several ranks shards the model over all of them (FSDP2) unless a setting says otherwise
COMMAND_DEFAULT = Layer("mindspeed-hf train's default: FSDP2 over every rank", {"parallel.dp_shard": -1},
                        {"parallel.dp_shard": "parallel.dp_shard"})


def _command_line_error(message: str) -> None:
    raise ValueError(f"command line: {message}")


def build_training_args(run: RunConfig, overrides: list[str], accelerated: bool):
    """TrainingArguments from the `training` section plus `--key value` overrides from the command line.

    With the accelerator on, MindSpeedTrainingArguments carrying the run's MindSpeedConfig; with it off (the
    bench baseline, MINDSPEED_HF_AUTO=0), plain TrainingArguments. Built before the model, so bad values fail
    first.
    """
    from transformers import HfArgumentParser, TrainingArguments

    from ..trainers.arguments import MindSpeedTrainingArguments

    cls = MindSpeedTrainingArguments if accelerated else TrainingArguments
    defaults = dict(run.training)
    defaults.setdefault("output_dir", "./mindspeed_hf_output")
    # Tokens seen per step feed the tokens/s in the log.
    defaults.setdefault("include_num_input_tokens_seen", "non_padding")
    from ..device import detect_device_type

    if detect_device_type() == "cpu":  # pinned host memory needs an accelerator (torch warns on every CPU run)
        defaults.setdefault("dataloader_pin_memory", False)
    if not accelerated and run.mindspeed.memory.recompute:
        # The plain-HF baseline does the same work through HF's own switch, so bench compares like with like.
        from ..releases.compat import training_args_checkpointing_names

        switch, kwargs = training_args_checkpointing_names()
        defaults.setdefault(switch, True)
        defaults.setdefault(kwargs, {"use_reentrant": False})
    parser = HfArgumentParser(cls)
    # Parse only what the command line gives (argparse would also run YAML strings through its type converters:
    # "non_padding" is not a bool), then lay it over the YAML values and build the dataclass from the dict.
    for action in parser._actions:
        if action.dest != "help":
            action.default = argparse.SUPPRESS
    parser.error = _command_line_error  # one line naming the option, not argparse's usage text and exit
    given, remaining = parser.parse_known_args(list(overrides))
    if remaining:
        flags = [r for r in remaining if r.startswith("--")] or remaining
        raise unknown_names("training argument", flags, [f"--{k}" for k in training_keys()])
    (args,) = parser.parse_dict({**defaults, **vars(given)})
    if accelerated:  # the run file's settings, under their own name (not as training arguments)
        sharded_by_deepspeed = bool(getattr(args, "deepspeed", None))  # DeepSpeed shards: no FSDP2 by default
        attach_run_file(args, run.layer, default=None if sharded_by_deepspeed else COMMAND_DEFAULT)
    return args
