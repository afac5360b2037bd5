"""MindSpeedTrainingArguments: TrainingArguments plus one `mindspeed_<key>` field per accelerator setting.

The fields are generated from the settings declared in mindspeed_hf.config, so a new setting is a new flag
(`--mindspeed_rope false`, `--mindspeed_recompute`) without being written here. Every field defaults to None,
"not set": the setting then comes from the lower layers (MINDSPEED_HF_* variables, the YAML file, the accelerate
launch environment, the defaults); a field that is set wins over all of them (see mindspeed_hf.config.resolve).
The config is resolved and validated in __post_init__, so a bad value fails when the arguments are parsed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from transformers import TrainingArguments

from ..config import Layer, MindSpeedConfig, ResolvedConfig, Setting, parse_reshard, resolve, settings
from ..value_kinds import parse_flag

ARGUMENTS_SOURCE = "training arguments (mindspeed_*)"


def hf_fsdp_layer(args: TrainingArguments) -> Layer:
    """What plain TrainingArguments state about our settings: `fsdp_config` (version 2: reshard_after_forward;
    cpu_offload, activation_checkpointing) and `parallelism_config` sizes."""
    from .fsdp_plan import hf_fsdp_settings

    values: dict[str, Any] = {}
    names: dict[str, str] = {}
    fsdp = hf_fsdp_settings(args)
    if fsdp is not None and fsdp["version"] == 2:
        if fsdp["reshard_after_forward"] is not None:  # HF fills a default in; only a stated one counts
            name = "fsdp_config['reshard_after_forward']"
            values["parallel.reshard_after_forward"] = parse_reshard(fsdp["reshard_after_forward"], name)
            names["parallel.reshard_after_forward"] = name
        for path, key in (("parallel.cpu_offload", "cpu_offload"), ("memory.recompute", "activation_checkpointing")):
            if parse_flag(fsdp[key], f"fsdp_config['{key}']"):
                values[path], names[path] = True, f"fsdp_config['{key}']"
    pc = getattr(args, "parallelism_config", None)
    if pc is not None:
        for ours, theirs in (("dp_replicate", "dp_replicate_size"), ("dp_shard", "dp_shard_size"), ("cp", "cp_size")):
            size = getattr(pc, theirs, None)
            if size is not None:
                values[f"parallel.{ours}"], names[f"parallel.{ours}"] = int(size), f"parallelism_config.{theirs}"
    return Layer("TrainingArguments (fsdp_config / parallelism_config)", values, names)


def resolve_for(args: TrainingArguments | None, base: MindSpeedConfig | None = None) -> ResolvedConfig:
    """The accelerator config for a trainer given `args`: its set mindspeed_* fields and its FSDP settings as
    explicit layers, over `base` (a config given to enable()) or else the environment / YAML / defaults."""
    explicit = []
    if args is not None:
        explicit.append(hf_fsdp_layer(args))
        if isinstance(args, _MindSpeedFields):
            explicit.append(args.mindspeed_layer())
    from ..memory.recompute import checkpointing_layer  # HF's own gradient_checkpointing=True: full recompute
    return resolve(explicit, base=base, fallback=[checkpointing_layer(args)] if args is not None else None)


class _MindSpeedFields:
    """Methods of MindSpeedTrainingArguments (its fields are generated below)."""

    def __post_init__(self) -> None:
        from . import deepspeed, wiring

        own_deepspeed_steps = not wiring.is_installed()  # else the wrapped TrainingArguments.__post_init__ runs them
        if own_deepspeed_steps:
            deepspeed.before_arguments(self)
        super().__post_init__()  # type: ignore[misc]
        # Validate now: a bad value must fail when the arguments are parsed, not after the model is built.
        self.mindspeed_config()
        if own_deepspeed_steps:
            deepspeed.after_arguments(self)

    def mindspeed_layer(self) -> Layer:
        """The mindspeed_* fields that were set, as setting path -> value."""
        values = {}
        for setting in settings():
            value = getattr(self, setting.argument)
            if value is not None:
                values[setting.path] = value.lower() if setting.key == "backend" else value
        return Layer(ARGUMENTS_SOURCE, values, {path: f"mindspeed_{path.rpartition('.')[2]}" for path in values})

    def mindspeed_resolved(self) -> ResolvedConfig:
        """The config these arguments give, with where each setting came from."""
        try:
            return resolve_for(self)  # type: ignore[arg-type]
        except ValueError as err:
            # Name the argument the user actually set, not only the config key behind it.
            raise ValueError(f"invalid mindspeed_* training argument: {err}") from err

    def mindspeed_config(self) -> MindSpeedConfig:
        """Build and validate the MindSpeedConfig these arguments describe."""
        return self.mindspeed_resolved().config

    @classmethod
    def config_fields(cls) -> dict[str, tuple[str | None, str]]:
        """Map of argument name -> (config section or None for top level, config key)."""
        return {s.argument: (s.section, s.key) for s in settings()}

    @classmethod
    def fields_from_config(cls, config: MindSpeedConfig) -> dict[str, Any]:
        """The mindspeed_* keyword arguments that reproduce `config` (used by the CLI's YAML runs): its settings
        that differ from the defaults (a size left at its default is not a request to shard)."""
        out = {}
        for s in settings():
            value = getattr(config if s.section is None else getattr(config, s.section), s.key)
            if value != s.default:
                out[s.argument] = value
        return out


def _argument(setting: Setting) -> tuple[str, type, Any]:
    metadata: dict[str, Any] = {"help": f"mindspeed_hf: {setting.help} (default {setting.default!r}; also "
                                        f"{setting.env}, or {setting.path} in MINDSPEED_HF_CONFIG)"}
    if setting.choices:
        metadata["choices"] = list(setting.choices)
    metadata.update(setting.parser_options)  # e.g. a bare `--mindspeed_recompute` means true
    # Annotated with the plain type so HfArgumentParser keeps bare boolean flags (`--mindspeed_recompute`);
    # None means "not set here".
    return setting.argument, setting.type, field(default=None, metadata=metadata)


MindSpeedTrainingArguments = dataclasses.make_dataclass(
    "MindSpeedTrainingArguments",
    [_argument(s) for s in settings()],
    bases=(_MindSpeedFields, TrainingArguments),
    namespace={"__module__": __name__,
               "__doc__": "TrainingArguments with the mindspeed_hf accelerator settings (kernels, parallel sizes, "
                          "memory): one `mindspeed_<key>` field per setting of mindspeed_hf.config."},
)
