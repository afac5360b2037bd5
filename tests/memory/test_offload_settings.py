"""memory.offload_activations / offload_layers / offload_min_bytes: declared once, reachable from YAML, the
environment and MindSpeedTrainingArguments (flags included), and checked with one-line errors naming the setting."""

from __future__ import annotations

import pytest
from transformers import HfArgumentParser

from mindspeed_hf.config import config_from_dict, load_config, resolve
from mindspeed_hf.trainers import MindSpeedTrainingArguments


def test_defaults():
    memory = config_from_dict({}).memory
    assert (memory.offload_activations, memory.offload_layers, memory.offload_min_bytes) == (False, "all", 1 << 20)


def test_yaml_environment_and_flags(tmp_path):
    path = tmp_path / "memory.yaml"
    path.write_text("memory: {offload_activations: true, offload_layers: [0, 2], offload_min_bytes: 4096}\n")
    memory = load_config(str(path)).memory
    assert (memory.offload_activations, memory.offload_layers, memory.offload_min_bytes) == (True, [0, 2], 4096)
    env = {"MINDSPEED_HF_MEMORY_OFFLOAD_ACTIVATIONS": "on", "MINDSPEED_HF_MEMORY_OFFLOAD_LAYERS": "2",
           "MINDSPEED_HF_MEMORY_OFFLOAD_MIN_BYTES": "0"}
    memory = resolve(env=env).config.memory
    assert (memory.offload_activations, memory.offload_layers, memory.offload_min_bytes) == (True, 2, 0)
    (args,) = HfArgumentParser(MindSpeedTrainingArguments).parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path), "--mindspeed_offload_activations", "--mindspeed_offload_layers", "0,1"])
    memory = args.mindspeed_config().memory
    assert (memory.offload_activations, memory.offload_layers) == (True, [0, 1])


@pytest.mark.parametrize("memory, message", [
    ({"offload_activations": "maybe"}, r"memory.offload_activations='maybe' must be true or false"),
    ({"offload_layers": 0}, r"memory.offload_layers=0 is not valid; choose all, an integer n >= 1"),
    ({"offload_min_bytes": -1}, r"memory.offload_min_bytes=-1 must be an integer >= 0 \(bytes\)"),
    ({"offload_min_bytes": "1MB"}, r"memory.offload_min_bytes='1MB' must be an integer >= 0"),
    ({"offload": True}, r"unknown config key memory.offload; valid config keys: .*memory.offload_activations"),
])
def test_bad_values_fail_naming_the_setting(memory, message):
    with pytest.raises(ValueError, match=message) as err:
        config_from_dict({"memory": memory})
    assert "\n" not in str(err.value)


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ValueError, match="MINDSPEED_HF_MEMORY_OFFLOAD_MIN_BYTES='lots' must be an integer >= 0"):
        resolve(env={"MINDSPEED_HF_MEMORY_OFFLOAD_MIN_BYTES": "lots"})
