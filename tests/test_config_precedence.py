"""Every setting is declared once (mindspeed_hf.config) and reaches the same config field whichever way it is given
- a MindSpeedTrainingArguments field / command-line flag, the YAML file, a MINDSPEED_HF_* variable, the accelerate
launch environment - with one precedence: explicit arguments > MINDSPEED_HF_* > YAML > accelerate env > defaults."""

from __future__ import annotations

import contextlib
import os

import pytest
import yaml
from transformers import HfArgumentParser

from mindspeed_hf.config import MindSpeedConfig, resolve, settings
from mindspeed_hf.releases.supported import check_ep_release
from mindspeed_hf.trainers import MindSpeedTrainingArguments

# A valid non-default value per setting that is valid on its own (cp_ulysses needs a cp it divides: tested with
# the context-parallel settings).
VALUES = {"backend": "torch", "kernels.loss_chunk_size": 96, "kernels.skip_logits": "always",
          "parallel.dp_replicate": 2, "parallel.dp_shard": 2, "parallel.cp": 2, "parallel.tp": 2,
          "parallel.prefetch": 3, "memory.offload_min_bytes": 4096}
with contextlib.suppress(ValueError):  # transformers 4.57 refuses ep > 1 (test_expert_parallel checks how)
    check_ep_release(2)
    VALUES["parallel.ep"] = 2
# The accelerate launch variables that mean one of our settings, as `accelerate launch` exports an FSDP2 config.
ACCELERATE = {"parallel.dp_replicate": "PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
              "parallel.dp_shard": "PARALLELISM_CONFIG_DP_SHARD_SIZE",
              "parallel.cp": "PARALLELISM_CONFIG_CP_SIZE",
              "parallel.tp": "PARALLELISM_CONFIG_TP_SIZE",
              "parallel.reshard_after_forward": "FSDP_RESHARD_AFTER_FORWARD",
              "parallel.cpu_offload": "FSDP_OFFLOAD_PARAMS",
              "memory.recompute": "FSDP_ACTIVATION_CHECKPOINTING"}
ACCELERATE_FSDP2 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true"}
SETTINGS = [s for s in settings() if s.type is bool or s.path in VALUES]
# Settings valid only with another one set too (given the same way): cp_vision shares the tower over cp ranks.
COMPANIONS = {"parallel.cp_vision": ("parallel.cp", 2)}


def _value(setting):
    return (not setting.default) if setting.type is bool else VALUES[setting.path]


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _field(config: MindSpeedConfig, setting):
    return getattr(config if setting.section is None else getattr(config, setting.section), setting.key)


def _nested(setting, value) -> dict:
    return {setting.key: value} if setting.section is None else {setting.section: {setting.key: value}}


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.path)
def test_every_way_of_giving_a_setting_reaches_the_same_field(setting, tmp_path):
    value = _value(setting)
    given = [(setting, value)]
    if setting.path in COMPANIONS:
        path, companion = COMPANIONS[setting.path]
        given.append((next(s for s in settings() if s.path == path), companion))
    flags = [arg for s, v in given for arg in (f"--{s.argument}", _text(v))]
    (flagged,) = HfArgumentParser(MindSpeedTrainingArguments).parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path), *flags])
    nested: dict = {}
    for s, v in given:
        for key, part in _nested(s, v).items():
            nested[key] = {**nested.get(key, {}), **part} if isinstance(part, dict) else part
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(nested))
    ways = {
        "flag": flagged.mindspeed_resolved(),
        "yaml": resolve(env={"MINDSPEED_HF_CONFIG": str(tmp_path / "c.yaml")}),
        "env": resolve(env={s.env: _text(v) for s, v in given}),
    }
    if setting.path in ACCELERATE and len(given) == 1:
        ways["accelerate"] = resolve(env={**ACCELERATE_FSDP2, ACCELERATE[setting.path]: _text(value)})
    for way, resolved in ways.items():
        assert _field(resolved.config, setting) == value, way
        assert resolved.is_set(setting.path), way
        assert resolved.config == _only(given), f"{way} changed other settings"


def _only(given) -> MindSpeedConfig:
    config = MindSpeedConfig()
    for setting, value in given:
        target = config if setting.section is None else getattr(config, setting.section)
        setattr(target, setting.key, value)
    return config


def test_every_axis_name_derives_from_the_one_table():
    """AXES (dp_replicate, dp_shard, cp, ep, tp): the setting, its flag, its variable, accelerate's variable and
    parallelism_config attribute, the mesh dim - each the name the rest of the package uses."""
    from types import SimpleNamespace

    from mindspeed_hf.config import AXES, hf_fsdp_layer
    from mindspeed_hf.config.schema import SETTINGS as SETTINGS_BY_PATH
    from mindspeed_hf.config.sources import _ACCELERATE_SIZES

    assert [a.name for a in AXES] == ["dp_replicate", "dp_shard", "cp", "ep", "tp"]
    for axis in AXES:
        setting = SETTINGS_BY_PATH[axis.path]
        assert (axis.argument, axis.flag, axis.env) == (setting.argument, f"--{setting.argument}", setting.env)
        assert axis.env == f"MINDSPEED_HF_PARALLEL_{axis.name.upper()}"
        assert _ACCELERATE_SIZES.get(axis.path) == axis.accelerate_env
    assert AXES[-1].accelerate_env == "PARALLELISM_CONFIG_TP_SIZE" and AXES[-1].accelerate_attribute == "tp_size"
    assert AXES[3].accelerate_env is None  # accelerate has no expert-parallel size
    pc = SimpleNamespace(dp_replicate_size=1, dp_shard_size=2, cp_size=1, tp_size=2)
    layer = hf_fsdp_layer(SimpleNamespace(fsdp=None, parallelism_config=pc))
    assert (layer.values["parallel.tp"], layer.names["parallel.tp"]) == (2, "parallelism_config.tp_size")
    assert "parallel.ep" not in layer.values


def test_tp_setting_in_every_source(tmp_path):
    """parallel.tp from the YAML, MINDSPEED_HF_PARALLEL_TP, --mindspeed_tp, accelerate's PARALLELISM_CONFIG_TP_SIZE;
    a bad value names where it came from."""
    (tmp_path / "c.yaml").write_text("parallel: {tp: 2}\n")
    assert resolve(env={"MINDSPEED_HF_CONFIG": str(tmp_path / "c.yaml")}).config.parallel.tp == 2
    assert resolve(env={"MINDSPEED_HF_PARALLEL_TP": "4"}).describe("parallel.tp") == (
        "MINDSPEED_HF_PARALLEL_TP=4 (environment (MINDSPEED_HF_*))")
    (flagged,) = HfArgumentParser(MindSpeedTrainingArguments).parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path), "--mindspeed_tp", "2"])
    assert flagged.mindspeed_resolved().describe("parallel.tp") == "mindspeed_tp=2 (training arguments (mindspeed_*))"
    accelerate = resolve(env={**ACCELERATE_FSDP2, "PARALLELISM_CONFIG_TP_SIZE": "2"})
    assert accelerate.describe("parallel.tp") == "PARALLELISM_CONFIG_TP_SIZE=2 (accelerate launch environment)"
    with pytest.raises(ValueError, match=r"^MINDSPEED_HF_PARALLEL_TP='two' must be an integer"):
        resolve(env={"MINDSPEED_HF_PARALLEL_TP": "two"})
    with pytest.raises(ValueError, match=r"parallel\.tp=0 must be >= 1"):
        resolve(yaml_source={"parallel": {"tp": 0}})


def test_precedence_on_one_setting(tmp_path):
    """reshard_after_forward can come from all five places: remove the highest each time."""
    path = "parallel.reshard_after_forward"
    (tmp_path / "c.yaml").write_text("parallel: {reshard_after_forward: false}\n")
    env = {**ACCELERATE_FSDP2, "FSDP_RESHARD_AFTER_FORWARD": "true",  # accelerate: true
           "MINDSPEED_HF_CONFIG": str(tmp_path / "c.yaml"),  # YAML: false
           "MINDSPEED_HF_PARALLEL_RESHARD_AFTER_FORWARD": "true"}  # ours: true
    explicit = MindSpeedTrainingArguments(output_dir=str(tmp_path), mindspeed_reshard_after_forward=False)
    layers = [explicit.mindspeed_layer()]
    assert resolve(layers, env=env).sources[path] == "training arguments (mindspeed_*)"
    assert resolve(layers, env=env).config.parallel.reshard_after_forward is False
    assert resolve(env=env).config.parallel.reshard_after_forward is True  # MINDSPEED_HF_* over YAML
    env.pop("MINDSPEED_HF_PARALLEL_RESHARD_AFTER_FORWARD")
    assert resolve(env=env).config.parallel.reshard_after_forward is False  # YAML over accelerate
    env.pop("MINDSPEED_HF_CONFIG")
    resolved = resolve(env=env)
    assert resolved.config.parallel.reshard_after_forward is True  # accelerate over the default
    assert resolved.describe(path) == "FSDP_RESHARD_AFTER_FORWARD=True (accelerate launch environment)"
    env.pop("FSDP_RESHARD_AFTER_FORWARD")
    assert not resolve(env=env).is_set(path)


def test_unset_arguments_leave_the_lower_layers(monkeypatch, tmp_path):
    (tmp_path / "c.yaml").write_text("kernels: {rope: false}\nparallel: {prefetch: 2}\n")
    monkeypatch.setenv("MINDSPEED_HF_CONFIG", str(tmp_path / "c.yaml"))
    args = MindSpeedTrainingArguments(output_dir=str(tmp_path), mindspeed_prefetch=4)
    config = args.mindspeed_config()
    assert (config.kernels.rope, config.parallel.prefetch) == (False, 4)


@pytest.mark.parametrize("env,message", [
    ({"MINDSPEED_HF_KERNELS_ROPE": "maybe"}, "MINDSPEED_HF_KERNELS_ROPE='maybe' must be true or false"),
    ({"MINDSPEED_HF_PARALLEL_PREFETCH": "two"}, "MINDSPEED_HF_PARALLEL_PREFETCH='two' must be an integer"),
    ({"MINDSPEED_HF_BACKEND": "tpu"}, "MINDSPEED_HF_BACKEND='tpu' is not valid; choose one of auto, torch, npu, cuda"),
    ({**ACCELERATE_FSDP2, "PARALLELISM_CONFIG_DP_SHARD_SIZE": "x"}, "PARALLELISM_CONFIG_DP_SHARD_SIZE='x' must be"),
    ({"MINDSPEED_HF_KERNELS_SKIP_LOGITS": "Sometimes"},
     "MINDSPEED_HF_KERNELS_SKIP_LOGITS='Sometimes' is not valid; choose one of auto, always, never"),
    ({"MINDSPEED_HF_PARALLEL_CP": "0"}, "parallel.cp=0 must be >= 1"),
])
def test_bad_environment_values_name_the_variable(env, message):
    with pytest.raises(ValueError) as err:
        resolve(env=env)
    assert message in str(err.value)


def test_a_misspelled_variable_is_refused_naming_the_nearest(monkeypatch):
    from mindspeed_hf.config import load_config

    monkeypatch.setenv("MINDSPEED_HF_PARALEL_CP", "2")
    with pytest.raises(ValueError, match=r"^unknown variable MINDSPEED_HF_PARALEL_CP \(did you mean "
                                         r"MINDSPEED_HF_PARALLEL_CP\?\)$"):
        load_config()


def test_a_settings_error_at_import_is_one_line(tmp_path):
    """`import mindspeed_hf` with a misspelled variable, a YAML typo or an unavailable backend: one line on stderr."""
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("parallel:\n  cp: [\n")
    cases = {"MINDSPEED_HF_PARALEL_CP": ("2", "did you mean MINDSPEED_HF_PARALLEL_CP"),
             "MINDSPEED_HF_CONFIG": (str(bad), "is not valid YAML (line 3, column 1)")}
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_HF_AUTO"}
    env["PYTHONPATH"] = ""  # no torch_npu stand-in
    # what Hugging Face's stack prints on its own when imported (bitsandbytes 0.50.2 on a CPU with AVX512-BF16 logs
    # a warning when PEFT imports it): not ours, left out of the count
    stack = subprocess.run([sys.executable, "-c", "import transformers.training_args"], capture_output=True,
                           text=True, env=env, timeout=300).stderr.strip().splitlines()
    for name, (value, expected) in cases.items():
        done = subprocess.run([sys.executable, "-c", "import mindspeed_hf"], capture_output=True, text=True,
                              env={**env, name: value}, timeout=300)
        assert done.returncode == 1
        lines = [line for line in done.stderr.strip().splitlines() if line not in stack]
        assert len(lines) == 1 and lines[0].startswith("mindspeed_hf: error: ") and expected in lines[0], lines


def test_an_accelerators_own_arguments_are_the_explicit_layer(monkeypatch):
    """What a loop's script gives `Accelerator(fsdp_plugin=..., parallelism_config=...)` is read like TrainingArguments'
    fsdp_config / parallelism_config, over MINDSPEED_HF_* (the override logged by the run); a plugin's defaults
    (accelerate fills them in) state nothing."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    from mindspeed_hf.config import ACCELERATOR_SOURCE, accelerator_layer, resolve_for_accelerator

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=False, cpu_offload=True)
    layer = accelerator_layer(plugin, ParallelismConfig(cp_size=2))
    assert layer.values == {"parallel.reshard_after_forward": False, "parallel.cpu_offload": True,
                            "parallel.dp_replicate": 1, "parallel.dp_shard": 1, "parallel.cp": 2, "parallel.tp": 1}
    assert layer.names["parallel.cp"] == "parallelism_config.cp_size"
    assert accelerator_layer(FullyShardedDataParallelPlugin(fsdp_version=2)).values == {}
    monkeypatch.setenv("MINDSPEED_HF_PARALLEL_CP", "4")
    resolved = resolve_for_accelerator(None, ParallelismConfig(cp_size=2))
    assert resolved.config.parallel.cp == 2 and resolved.sources["parallel.cp"] == ACCELERATOR_SOURCE
    assert [(o.path, o.replaced) for o in resolved.overrides] == [("parallel.cp", 4)]
