"""MindSpeedTrainingArguments: TrainingArguments plus one `mindspeed_<key>` field per accelerator setting.

The fields are generated from the settings declared in mindspeed_hf.config, so a new setting is a new flag
(`--mindspeed_rope false`, `--mindspeed_recompute`) without being written here. Every field defaults to None,
"not set": the setting then comes from the lower layers (MINDSPEED_HF_* variables, the YAML file, the accelerate
launch environment, the defaults); a field that is set wins over all of them (see mindspeed_hf.config.resolve).
The config is resolved and validated in __post_init__, so a bad value fails when the arguments are parsed (a
trainer given these arguments then reuses that resolution and logs its overrides).
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from transformers import TrainingArguments

from ..config import MindSpeedConfig, ResolvedConfig, Setting, resolve_for, settings
from ..config.sources import ARGUMENTS_SOURCE, Layer, arguments_layer, hf_fsdp_layer
from ..errors import say_once_if_uncaught
from . import deepspeed

__all__ = ["ARGUMENTS_SOURCE", "MindSpeedTrainingArguments", "hf_fsdp_layer", "resolve_for"]


class _MindSpeedFields:
    """Methods of MindSpeedTrainingArguments (its fields are generated below)."""

    def __post_init__(self) -> None:
        # the wiring's TrainingArguments.__post_init__ (wiring.py) runs the DeepSpeed steps when it is installed
        own_deepspeed_steps = not getattr(TrainingArguments.__post_init__, "_mindspeed_wiring", False)
        if own_deepspeed_steps:
            deepspeed.before_arguments(self)
        super().__post_init__()  # type: ignore[misc]
        # Validate now: a bad value must fail when the arguments are parsed, not after the model is built.
        self.mindspeed_config()
        if own_deepspeed_steps:
            deepspeed.after_arguments(self)

    def mindspeed_layer(self) -> Layer:
        """The mindspeed_* fields that were set, as setting path -> value."""
        return arguments_layer(self)

    def mindspeed_resolved(self) -> ResolvedConfig:
        """The config these arguments give, with where each setting came from."""
        try:
            return resolve_for(self)  # type: ignore[arg-type]
        except ValueError as err:
            # Name the argument the user actually set, not only the config key behind it; one line if uncaught.
            raise say_once_if_uncaught(ValueError(f"invalid mindspeed_* training argument: {err}")) from err

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
