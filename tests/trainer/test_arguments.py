"""MindSpeedTrainingArguments: HfArgumentParser flags / YAML / JSON round trips, validation at construction."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import yaml
from transformers import HfArgumentParser

from mindspeed_hf.config import SECTIONS, MindSpeedConfig, config_from_dict, settings
from mindspeed_hf.runtime import run_of
from mindspeed_hf.trainers import MindSpeedTrainingArguments

FLAGS = ["--output_dir", "out", "--mindspeed_backend", "torch", "--mindspeed_rope", "false",
         "--mindspeed_loss_chunk_size", "256", "--mindspeed_dp_replicate", "2", "--mindspeed_dp_shard", "2",
         "--mindspeed_recompute"]
EXPECTED = {"backend": "torch", "kernels": {"rope": False, "loss_chunk_size": 256},
            "parallel": {"dp_replicate": 2, "dp_shard": 2}, "memory": {"recompute": True}}


def _parser() -> HfArgumentParser:
    return HfArgumentParser(MindSpeedTrainingArguments)


def test_defaults_match_config_defaults():
    args = MindSpeedTrainingArguments(output_dir="out")
    assert args.mindspeed_config() == MindSpeedConfig()


def test_every_config_setting_has_an_argument():
    config = MindSpeedConfig()
    covered = set(MindSpeedTrainingArguments.config_fields().values())
    expected = {(None, "backend")} | {
        (section, f.name) for section in SECTIONS
        for f in dataclasses.fields(getattr(config, section))
    }
    assert covered == expected


def test_cli_flags():
    (args,) = _parser().parse_args_into_dataclasses(args=FLAGS)
    assert args.mindspeed_config() == config_from_dict(EXPECTED)
    assert args.mindspeed_swiglu is None and args.mindspeed_rope is False  # not given: None, the default applies
    assert args.mindspeed_config().kernels.swiglu is True


def test_yaml_and_json_round_trip(tmp_path):
    (args,) = _parser().parse_args_into_dataclasses(args=FLAGS)
    values = {k: getattr(args, k) for k in MindSpeedTrainingArguments.config_fields()}
    values["output_dir"] = "out"
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(values))
    (tmp_path / "a.json").write_text(json.dumps(values))
    (from_yaml,) = _parser().parse_yaml_file(str(tmp_path / "a.yaml"))
    (from_json,) = _parser().parse_json_file(str(tmp_path / "a.json"))
    assert from_yaml.mindspeed_config() == from_json.mindspeed_config() == args.mindspeed_config()
    # and back: the config rebuilds the same arguments
    again = MindSpeedTrainingArguments(output_dir="out", **MindSpeedTrainingArguments.fields_from_config(
        args.mindspeed_config()))
    assert again.mindspeed_config() == args.mindspeed_config()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("mindspeed_cp", 0, "parallel.cp=0 must be >= 1"),
    ("mindspeed_cp_ulysses", 3, "parallel.cp_ulysses=3 must divide parallel.cp=1"),
    ("mindspeed_ep", 0, "parallel.ep=0 must be >= 1"),
    ("mindspeed_dp_shard", 0, "parallel.dp_shard=0"),
    ("mindspeed_loss_chunk_size", -1, "loss_chunk_size=-1"),
    ("mindspeed_backend", "tpu", "backend='tpu' is not valid; choose one of auto, torch, npu, cuda"),
])
def test_bad_values_fail_at_construction(field, value, message):
    with pytest.raises(ValueError, match="invalid mindspeed_\\* training argument") as err:
        MindSpeedTrainingArguments(output_dir="out", **{field: value})
    assert message in str(err.value)


def test_bad_flag_value_rejected_by_parser():
    with pytest.raises(SystemExit):  # argparse's `choices` names the valid backends
        _parser().parse_args_into_dataclasses(args=["--output_dir", "o", "--mindspeed_backend", "tpu"])


def test_backend_env_applies_unless_the_argument_is_set(monkeypatch):
    monkeypatch.setenv("MINDSPEED_HF_BACKEND", "torch")
    assert MindSpeedTrainingArguments(output_dir="out").mindspeed_config().backend == "torch"
    explicit = MindSpeedTrainingArguments(output_dir="out", mindspeed_backend="auto")
    assert explicit.mindspeed_config().backend == "auto"  # explicit arguments win over the environment


def test_fields_are_generated_from_the_settings():
    fields = {f.name: f for f in dataclasses.fields(MindSpeedTrainingArguments)}
    for setting in settings():
        f = fields[setting.argument]
        assert f.default is None  # not set: the lower layers decide
        assert setting.help in f.metadata["help"] and setting.env in f.metadata["help"]


def test_one_trainer_resolves_once_and_logs_each_override_once(tmp_path, monkeypatch, caplog):
    """An override (MINDSPEED_HF_KERNELS_ROPE=false under mindspeed_rope=True) is one log line per Trainer
    construction - the arguments validated, then the trainer set up - and the layers are resolved once."""
    import importlib

    from test_wiring import dataset, quick_args, tiny_model

    import mindspeed_hf
    from mindspeed_hf.trainers import MindSpeedTrainer

    resolving = importlib.import_module("mindspeed_hf.config.resolve")  # the module; config.resolve is the function
    monkeypatch.setenv("MINDSPEED_HF_KERNELS_ROPE", "false")
    mindspeed_hf.enable()  # as `import mindspeed_hf` does: the process config, resolved before any trainer
    merges = []
    merge = resolving._merge
    monkeypatch.setattr(resolving, "_merge", lambda *layers: merges.append(layers) or merge(*layers))
    monkeypatch.setattr(resolving, "_RESOLVED", {})
    with caplog.at_level(logging.INFO, logger="mindspeed_hf"):
        args = quick_args(tmp_path, MindSpeedTrainingArguments, mindspeed_rope=True)
        trainers = [MindSpeedTrainer(model=tiny_model(), args=args, train_dataset=dataset()) for _ in range(2)]
    lines = [r.getMessage() for r in caplog.records if "overrides" in r.getMessage()]
    assert lines == 2 * ["mindspeed_hf: kernels.rope=True from the training arguments (mindspeed_*) overrides False "
                         "from the environment (MINDSPEED_HF_*)"]  # one per trainer
    assert len(merges) == 1
    assert all(run_of(t).config.kernels.rope is True for t in trainers)
    assert run_of(trainers[0]).config is not run_of(trainers[1]).config  # each trainer owns its config
