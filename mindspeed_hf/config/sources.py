"""Every place a setting can come from, each read into one Layer ({setting path: value} plus how the source spells
each setting, for messages): the MINDSPEED_HF_* variables, the YAML / JSON file (MINDSPEED_HF_CONFIG), the
environment `accelerate launch` exports, a whole config given to enable(), and a trainer's TrainingArguments (its
set mindspeed_* fields, `fsdp_config` / `parallelism_config`, and HF's own activation checkpointing switch).

Text is read through each setting's value kind, so an error names the variable as the user wrote it. Reading a
source decides nothing: resolve.py puts the layers in their one precedence.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import LOG_LEVELS
from ..value_kinds import choice, flag, parse_flag, unknown_names
from .axes import AXES
from .schema import ENV_PREFIX, SETTINGS, MindSpeedConfig, flatten, settings


@dataclass
class Layer:
    """Settings from one source: `values` maps setting paths (`parallel.dp_shard`) to values; `names` says how the
    source spells a setting (`mindspeed_dp_shard`, `MINDSPEED_HF_PARALLEL_DP_SHARD`), for messages."""

    source: str
    values: dict[str, Any]
    names: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- the process
#: MINDSPEED_HF_* variables that are not settings of the config.
OTHER_VARIABLES = ("MINDSPEED_HF_AUTO", "MINDSPEED_HF_CONFIG", "MINDSPEED_HF_LOG_LEVEL")


#: the process switches among them, each with its value kind (MINDSPEED_HF_CONFIG is a path: read by yaml_layer)
_SWITCHES = {"MINDSPEED_HF_AUTO": flag(), "MINDSPEED_HF_LOG_LEVEL": choice(LOG_LEVELS, fold_case=True)}


def check_process_switches(env: Mapping[str, str]) -> None:
    """MINDSPEED_HF_AUTO (true/false) and MINDSPEED_HF_LOG_LEVEL (a logging level): a value nobody can read is a
    one-line ValueError naming the variable and the valid choices."""
    for name, kind in _SWITCHES.items():
        if env.get(name) is not None:
            kind.read(name, env[name])


def check_variables(env: Mapping[str, str]) -> None:
    """A MINDSPEED_HF_* variable nobody reads is a typo: refused, naming the nearest real one; the process switches'
    values are checked too."""
    known = {s.env for s in SETTINGS.values()} | set(OTHER_VARIABLES)
    unknown = [name for name in env if name.startswith(ENV_PREFIX) and name not in known]
    if unknown:
        raise unknown_names("variable", unknown, sorted(known))
    check_process_switches(env)


def env_layer(env: Mapping[str, str] | None = None) -> Layer:
    """MINDSPEED_HF_<SECTION>_<KEY> (and MINDSPEED_HF_BACKEND) variables; an unknown MINDSPEED_HF_* is refused."""
    env = os.environ if env is None else env
    check_variables(env)
    found = [s for s in SETTINGS.values() if env.get(s.env)]
    return Layer("environment (MINDSPEED_HF_*)", {s.path: s.kind.read(s.env, env[s.env]) for s in found},
                 {s.path: s.env for s in found})


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
_ACCELERATE_SIZES = {axis.path: axis.accelerate_env for axis in AXES if axis.accelerate}  # from the one table
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
            values[path], names[path] = SETTINGS[path].kind.read(name, env[name]), name
    fsdp2 = env.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true") and env.get("FSDP_VERSION", "1") == "2"
    for path, name in _ACCELERATE_FSDP.items():
        if fsdp2 and env.get(name):
            parse = parse_reshard if path == "parallel.reshard_after_forward" else parse_flag
            values[path], names[path] = parse(env[name], name), name
    return Layer(ACCELERATE_SOURCE, values, names)


def enable_layer(config: MindSpeedConfig) -> Layer:
    """A whole config given to mindspeed_hf.enable(): it stands for every layer below the explicit ones."""
    return Layer("config given to mindspeed_hf.enable()", flatten(config.to_dict()))


def process_layers(yaml_source: Any = None, env: Mapping[str, str] | None = None,
                   base: MindSpeedConfig | None = None) -> list[Layer]:
    """The layers below a trainer's own, lowest first: `base` (a config given to enable()) alone, or else the
    accelerate launch environment, the YAML file and the MINDSPEED_HF_* variables."""
    if base is not None:
        return [enable_layer(base)]
    return [accelerate_env_layer(env), yaml_layer(yaml_source, env), env_layer(env)]


# ---------------------------------------------------------------------------------------------- a trainer's arguments
ARGUMENTS_SOURCE = "training arguments (mindspeed_*)"


def arguments_layer(args: Any) -> Layer:
    """The mindspeed_* fields of MindSpeedTrainingArguments that were set (None: not set)."""
    values = {}
    for setting in settings():
        value = getattr(args, setting.argument)
        if value is not None:
            values[setting.path] = value.lower() if setting.kind.fold_case and isinstance(value, str) else value
    return Layer(ARGUMENTS_SOURCE, values, {path: f"mindspeed_{path.rpartition('.')[2]}" for path in values})


def hf_fsdp_settings(args: Any) -> dict[str, Any] | None:
    """The FSDP request of TrainingArguments (`fsdp` + `fsdp_config`), the same across releases: transformers 5
    normalises it into `fsdp_plugin_args`; 4.57 keeps the `fsdp` options and the `fsdp_config` dict (keys without
    their `fsdp_` prefix) and hands the rest to accelerate through the environment. None: not asked for (or XLA)."""
    if not getattr(args, "fsdp", None):
        return None
    config = getattr(args, "fsdp_config", None) or {}
    # The `fsdp` options (4.57 .. 5.19 keep the list of FSDPOption; later releases take fsdp=True and fsdp_config).
    options = {str(getattr(o, "value", o)) for o in args.fsdp} if isinstance(args.fsdp, list) else set()
    classes = config.get("transformer_layer_cls_to_wrap")
    classes = ",".join(classes) if isinstance(classes, list | tuple) else classes
    reshard = config.get("reshard_after_forward")
    if reshard is None and "shard_grad_op" in options:  # ZeRO-2 strategy: a statement (full_shard is also what
        reshard = False  # fsdp=True means, and the default anyway)
    if hasattr(args, "fsdp_plugin_args"):  # transformers 5
        plugin = args.fsdp_plugin_args
        if plugin is None:  # fsdp_config xla: not ours
            return None
        return {"version": int(plugin.get("fsdp_version", 2)), "auto_wrap_policy": plugin.get("auto_wrap_policy"),
                "classes": plugin.get("transformer_cls_names_to_wrap") or classes,
                "state_dict_type": plugin.get("state_dict_type") if "state_dict_type" in config else None,
                "reshard_after_forward": reshard,
                **{k: plugin.get(k, False) for k in ("cpu_offload", "activation_checkpointing",
                                                     "cpu_ram_efficient_loading")}}
    if config.get("xla"):
        return None
    policy = None
    if "auto_wrap" in options:
        policy = "SIZE_BASED_WRAP" if config.get("min_num_params", 0) > 0 else "TRANSFORMER_BASED_WRAP"
    return {"version": int(config.get("version", 1)), "auto_wrap_policy": policy, "classes": classes,
            "state_dict_type": config.get("state_dict_type"),
            "reshard_after_forward": reshard, "cpu_offload": "offload" in options,
            **{k: config.get(k, False) for k in ("activation_checkpointing", "cpu_ram_efficient_loading")}}


def plugin_fsdp_settings(plugin: Any) -> dict[str, Any] | None:
    """The FSDP request of an accelerate `FullyShardedDataParallelPlugin` a script gave its Accelerator, in the form
    of hf_fsdp_settings. A knob the plugin holds at accelerate's default counts as not stated (the plugin fills its
    defaults in, from the FSDP_* environment too). None: no plugin."""
    if plugin is None:
        return None
    wrap = getattr(plugin, "auto_wrap_policy", None)
    wrap = str(getattr(wrap, "__name__", wrap) or "").lower()
    policy = "TRANSFORMER_BASED_WRAP" if "transformer" in wrap else "SIZE_BASED_WRAP" if "size" in wrap else None
    classes = getattr(plugin, "transformer_cls_names_to_wrap", None)
    state = getattr(plugin, "state_dict_type", None)
    reshard = getattr(plugin, "reshard_after_forward", True)
    offload = getattr(plugin, "cpu_offload", None)
    return {"version": int(getattr(plugin, "fsdp_version", None) or 1), "auto_wrap_policy": policy,
            "classes": ",".join(classes) if isinstance(classes, list | tuple) else classes,
            "state_dict_type": getattr(state, "name", state),
            "reshard_after_forward": None if reshard is True else getattr(reshard, "name", reshard),
            # torch's OffloadPolicy() is "no offload"; CPUOffloadPolicy (FSDP2) / CPUOffload(True) (FSDP1) offload
            "cpu_offload": type(offload).__name__ == "CPUOffloadPolicy" or bool(getattr(offload, "offload_params",
                                                                                      False)),
            "activation_checkpointing": bool(getattr(plugin, "activation_checkpointing", False)),
            "cpu_ram_efficient_loading": bool(getattr(plugin, "cpu_ram_efficient_loading", False))}


def _fsdp_and_sizes_layer(source: str, fsdp: dict[str, Any] | None, pc: Any, where: str) -> Layer:
    """Our settings stated by an FSDP request (version 2: reshard_after_forward, cpu_offload,
    activation_checkpointing) and an accelerate ParallelismConfig's sizes; `where` prefixes how the source names
    them in messages (`fsdp_config`, `fsdp_plugin`)."""
    values: dict[str, Any] = {}
    names: dict[str, str] = {}
    if fsdp is not None and fsdp["version"] == 2:
        if fsdp["reshard_after_forward"] is not None:  # a default filled in does not count; only a stated one
            name = f"{where}['reshard_after_forward']"
            values["parallel.reshard_after_forward"] = parse_reshard(fsdp["reshard_after_forward"], name)
            names["parallel.reshard_after_forward"] = name
        for path, key in (("parallel.cpu_offload", "cpu_offload"), ("memory.recompute", "activation_checkpointing")):
            if parse_flag(fsdp[key], f"{where}['{key}']"):
                values[path], names[path] = True, f"{where}['{key}']"
    if pc is not None:
        for axis in AXES:
            theirs = axis.accelerate_attribute
            size = getattr(pc, theirs, None) if theirs else None
            if size is not None:
                values[axis.path], names[axis.path] = int(size), f"parallelism_config.{theirs}"
    return Layer(source, values, names)


def hf_fsdp_layer(args: Any) -> Layer:
    """What plain TrainingArguments state about our settings: `fsdp_config` (version 2: reshard_after_forward;
    cpu_offload, activation_checkpointing) and `parallelism_config` sizes."""
    return _fsdp_and_sizes_layer("TrainingArguments (fsdp_config / parallelism_config)", hf_fsdp_settings(args),
                                 getattr(args, "parallelism_config", None), "fsdp_config")


ACCELERATOR_SOURCE = "Accelerator arguments (fsdp_plugin / parallelism_config)"


def accelerator_layer(fsdp_plugin: Any = None, parallelism_config: Any = None) -> Layer:
    """What a script's `Accelerator(fsdp_plugin=..., parallelism_config=...)` states about our settings, read as
    TrainingArguments' fsdp_config / parallelism_config are."""
    return _fsdp_and_sizes_layer(ACCELERATOR_SOURCE, plugin_fsdp_settings(fsdp_plugin), parallelism_config,
                                 "fsdp_plugin")


def checkpointing_layer(args: Any) -> Layer:
    """TrainingArguments' own switch (`gradient_checkpointing` / `activation_checkpointing`) as a fallback layer:
    True means memory.recompute=full where no source set memory.recompute (see resolve's `fallback`)."""
    from ..releases.compat import training_args_checkpointing_names  # imports torch: only once a trainer asks

    switch, _ = training_args_checkpointing_names()
    if not getattr(args, switch, False):
        return Layer("TrainingArguments", {})
    return Layer(f"TrainingArguments ({switch})", {"memory.recompute": True}, {"memory.recompute": switch})


#: where a run file's layer rides on its TrainingArguments (`mindspeed-hf train RUN.yaml`: recipes/run_config.py)
_RUN_FILE = "mindspeed_run_file"


def attach_run_file(args: Any, layer: Layer | None, default: Layer | None = None) -> None:
    """Keep the settings a run file states on the TrainingArguments built from it, and the command's own `default`:
    they are resolved as layers of their own, the file's above the process layers and below the arguments
    themselves, the default below every source (see run_file_layers)."""
    vars(args)[_RUN_FILE] = (default, layer)


def run_file_layers(args: Any) -> tuple[list[Layer], list[Layer]]:
    """(the command's default layers, the run file's layers) attached to `args` (attach_run_file): lists of zero or
    one; none for other arguments."""
    default, layer = (vars(args).get(_RUN_FILE) if hasattr(args, "__dict__") else None) or (None, None)
    return [default] if default is not None else [], [layer] if layer is not None else []


def trainer_layers(args: Any) -> tuple[list[Layer], list[Layer]]:
    """A trainer's own layers from its TrainingArguments: the explicit ones (fsdp_config / parallelism_config, and
    the set mindspeed_* fields of MindSpeedTrainingArguments) and the fallback (HF's checkpointing switch)."""
    if args is None:
        return [], []
    explicit = [hf_fsdp_layer(args)]
    if callable(getattr(args, "mindspeed_layer", None)):  # MindSpeedTrainingArguments
        explicit.append(args.mindspeed_layer())
    return explicit, [checkpointing_layer(args)]
