"""The accelerator's settings: declared once (schema.py), read from every source (sources.py), put in one
precedence (resolve.py). This module hands their public names on; it imports no torch and no transformers.

A setting can be given in several places. They are read as layers, and the higher layer wins:

    explicit arguments  >  MINDSPEED_HF_* variables  >  YAML file  >  accelerate launch environment  >  defaults

(explicit arguments: what a trainer was given - MindSpeedTrainingArguments fields that were set, TrainingArguments
`fsdp_config` / `parallelism_config`, or a config passed to `enable()`). Two explicit sources that disagree are an
error; a lower layer overridden by a higher one is logged once. Unknown keys and bad values fail here, before any
model is built, naming the setting and the valid choices.
"""

from .axes import AXES, AXIS, SIZE_PATHS, WORLD_AXES, Axis
from .resolve import (
    Override,
    ResolvedConfig,
    load_config,
    resolve,
    resolve_for,
    resolve_for_accelerator,
    resolve_layers,
)
from .schema import (
    BACKEND_CHOICES,
    ENV_PREFIX,
    RECOMPUTE_MODULES,
    SECTIONS,
    TRAIN_RECIPES,
    CheckpointConfig,
    DataConfig,
    KernelConfig,
    MemoryConfig,
    MindSpeedConfig,
    MoEConfig,
    ParallelConfig,
    Setting,
    config_from_dict,
    flatten,
    settings,
)
from .sources import (
    ACCELERATE_SOURCE,
    ACCELERATOR_SOURCE,
    ARGUMENTS_SOURCE,
    OTHER_VARIABLES,
    Layer,
    accelerate_env_layer,
    accelerator_layer,
    check_variables,
    env_layer,
    hf_fsdp_layer,
    hf_fsdp_settings,
    parse_reshard,
    plugin_fsdp_settings,
    read_config_file,
    trainer_layers,
    yaml_layer,
)

__all__ = [
    "ACCELERATE_SOURCE", "ACCELERATOR_SOURCE", "ARGUMENTS_SOURCE", "AXES", "AXIS", "Axis", "BACKEND_CHOICES",
    "CheckpointConfig", "DataConfig", "ENV_PREFIX", "KernelConfig", "Layer", "MemoryConfig",
    "MindSpeedConfig", "MoEConfig", "OTHER_VARIABLES", "Override", "ParallelConfig", "RECOMPUTE_MODULES",
    "ResolvedConfig", "SECTIONS", "SIZE_PATHS", "Setting", "TRAIN_RECIPES", "WORLD_AXES", "accelerate_env_layer",
    "accelerator_layer", "check_variables", "config_from_dict", "env_layer", "flatten",
    "hf_fsdp_layer", "hf_fsdp_settings", "load_config", "parse_reshard", "plugin_fsdp_settings", "read_config_file",
    "resolve", "resolve_for", "resolve_for_accelerator", "resolve_layers", "settings", "trainer_layers", "yaml_layer",
]
