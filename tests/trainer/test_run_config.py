"""`mindspeed-hf train` run descriptions: bad keys and missing paths fail with the right message, before any model
is built."""

from __future__ import annotations

import copy

import pytest
import yaml
from conftest import cli

from mindspeed_hf.config import read_config_file
from mindspeed_hf.recipes import run_config
from mindspeed_hf.recipes.default_run import DEFAULT_RUN_CONFIG

BASE = read_config_file(DEFAULT_RUN_CONFIG)


def _write(tmp_path, mutate) -> str:
    data = copy.deepcopy(BASE)
    # Point the relative paths of the default run at the shipped files.
    data["model"]["tokenizer"] = "builtin:tokenizer"
    data["data"]["train"], data["data"]["eval"] = "builtin:train.jsonl", "builtin:eval.jsonl"
    mutate(data)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture
def no_model_building(monkeypatch):
    """Any attempt to build a model fails the test: validation must come first."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the config was validated")

    for name in ("from_config", "from_pretrained"):
        monkeypatch.setattr(transformers.AutoModelForCausalLM, name, refuse)


def test_default_run_config_is_valid():
    run = run_config.load_run_config()
    assert run.model.config["model_type"] == "qwen3"
    assert run.data.train.endswith("train.jsonl") and run.data.eval.endswith("eval.jsonl")
    assert run.training["max_steps"] > 0


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d.update(trainig={}), "unknown key trainig (did you mean training?); valid keys: model, data"),
    (lambda d: d["model"].update(hidden=3), "unknown key model.hidden; valid keys: model.config, model.name_or_path"),
    (lambda d: d["data"].update(pth="x"), "unknown key data.pth; valid keys: data.train, data.eval"),
    (lambda d: d["features"].update(rms_nrom=True), "unknown key features.rms_nrom (did you mean features.rms_norm?)"),
    (lambda d: d["parallel"].update(pp=2), "unknown key parallel.pp; valid keys: parallel.dp_replicate"),
    (lambda d: d["training"].update(learning_rat=1.0), "training.learning_rat (did you mean training.learning_rate?)"),
    (lambda d: d["training"].update(mindspeed_rope=False), "accelerator settings go in the `features`"),
    (lambda d: d["evaluation"].update(n=1), "unknown key evaluation.n; valid keys: evaluation.enabled"),
    (lambda d: d["features"].update(backend="tpu"), "backend='tpu' is not valid"),
    (lambda d: d["parallel"].update(cp=0), "parallel.cp=0 must be >= 1"),
    (lambda d: d.update(checkpoints={"export": True}), "key checkpoints.export (did you mean checkpoints.export_hf?)"),
    (lambda d: d["model"].update(name_or_path="x"), "exactly one of model.config"),
    (lambda d: d["model"].update(dtype="float8"), "model.dtype='float8' is not valid"),
    (lambda d: d["training"].update(max_steps="lots"), "training.max_steps='lots' must be an integer"),
    (lambda d: d["training"].update(learning_rate="fast"), "training.learning_rate='fast' must be a number"),
    (lambda d: d["training"].update(bf16="maybe"), "training.bf16='maybe' must be true or false"),
])
def test_bad_keys_and_values(tmp_path, no_model_building, mutate, message):
    with pytest.raises(ValueError) as err:
        run_config.load_run_config(_write(tmp_path, mutate))
    assert message in str(err.value)


@pytest.mark.parametrize(("mutate", "setting"), [
    (lambda d: d["data"].update(train="missing.jsonl"), "data.train"),
    (lambda d: d["data"].update(eval="missing.jsonl"), "data.eval"),
    (lambda d: d["model"].update(tokenizer="no_tokenizer_here"), "model.tokenizer"),
    (lambda d: (d["model"].pop("config"), d["model"].update(name_or_path="no_model_here")), "model.name_or_path"),
])
def test_missing_paths_name_the_setting(tmp_path, no_model_building, mutate, setting):
    with pytest.raises(FileNotFoundError) as err:
        run_config.load_run_config(_write(tmp_path, mutate))
    assert setting in str(err.value) and "does not exist" in str(err.value)


def test_training_overrides(no_model_building):
    run = run_config.load_run_config()
    args = run_config.build_training_args(run, ["--max_steps", "7", "--output_dir", "elsewhere"], accelerated=True)
    assert args.max_steps == 7 and args.output_dir == "elsewhere"
    assert args.mindspeed_config() == run.mindspeed
    assert args.include_num_input_tokens_seen == "non_padding"  # YAML/default strings are not run through argparse
    plain = run_config.build_training_args(run, [], accelerated=False)
    assert type(plain).__name__ == "TrainingArguments" and plain.max_steps == run.training["max_steps"]
    with pytest.raises(ValueError, match="^unknown training argument --not_a_key$"):
        run_config.build_training_args(run, ["--not_a_key", "3"], accelerated=True)


def test_features_map_onto_config(tmp_path):
    def mutate(d):
        d["features"] = {"backend": "torch", "rope": False, "loss_chunk_size": 128, "recompute": True}
        d["parallel"] = {"dp_shard": 2, "cpu_offload": True}
        d["checkpoints"] = {"export_hf": True}

    config = run_config.load_run_config(_write(tmp_path, mutate)).mindspeed
    assert config.checkpoints.export_hf is True
    assert config.backend == "torch" and config.kernels.rope is False and config.kernels.swiglu is True
    assert config.kernels.loss_chunk_size == 128 and config.memory.recompute is True
    assert config.parallel.dp_shard == 2 and config.parallel.cpu_offload is True


def test_cli_reports_config_errors_before_work(tmp_path):
    out = tmp_path / "never_created"
    bad = _write(tmp_path, lambda d: d["data"].update(train="nope.jsonl"))
    proc = cli(["train", bad, "--output_dir", str(out)], check=False)
    assert proc.returncode == 2
    assert "mindspeed-hf train: error:" in proc.stderr and "data.train" in proc.stderr and "nope.jsonl" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_yaml_1_1_numbers_are_taken_as_hf_takes_them(tmp_path, no_model_building):
    """`learning_rate: 3e-3` is a string to YAML 1.1 (PyYAML): converted as the command line converts it."""
    path = _write(tmp_path, lambda d: d["training"].update(max_steps="7"))
    text = open(path).read()
    assert "learning_rate:" in text
    lines = [("  learning_rate: 3e-3" if ln.strip().startswith("learning_rate:") else ln) for ln in text.splitlines()]
    open(path, "w").write("\n".join(lines) + "\n")
    run = run_config.load_run_config(path)
    assert run.training["learning_rate"] == 3e-3 and run.training["max_steps"] == 7


def test_invalid_yaml_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  config: {model_type: qwen3\ndata: [\n")
    with pytest.raises(ValueError) as err:
        run_config.load_run_config(str(path))
    message = str(err.value)
    assert "broken.yaml" in message and "is not valid YAML (line" in message and "\n" not in message
