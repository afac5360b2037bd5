"""Bad inputs to `mindspeed-hf train`: config YAML, run YAML, data files, model path, mesh sizes, environment
variables, command-line options. Each gives exactly one line on stderr naming the setting or file (checked by
message), exit status 2, no traceback, and no model is ever built. Run in-process (`main([...])`) to stay fast."""

from __future__ import annotations

import importlib.util
import os

import pytest
import yaml

import mindspeed_hf
from mindspeed_hf.cli import main as cli_main
from mindspeed_hf.recipes import text as cli_train
from mindspeed_hf.recipes.default_run import DEFAULT_RUN_CONFIG, DEFAULT_RUN_DIR

GOOD_ROW = '{"prompt": "copy : a b =", "completion": " a b"}'


def _base() -> dict:
    run = yaml.safe_load(DEFAULT_RUN_CONFIG.read_text())
    run["model"]["tokenizer"] = str(DEFAULT_RUN_DIR / "tokenizer")
    run["data"] = {"train": "train.jsonl", "max_length": 32}
    run["training"].update(max_steps=1, output_dir="out")
    return run


def _set(run: dict, dotted: str, value) -> dict:
    *parents, key = dotted.split(".")
    node = run
    for name in parents:
        node = node.setdefault(name, {})
    if value is _DELETE:
        node.pop(key, None)
    else:
        node[key] = value
    return run


_DELETE = object()

# id -> (run YAML edits, data file text, extra argv, env, fragments the one line must hold)
CASES: dict[str, tuple[dict, str | None, list[str], dict[str, str], list[str]]] = {
    # ---- the run YAML
    "yaml-syntax": ({"__text__": "model:\n  config: [1, 2\ntraining: {}\n"}, None, [], {},
                    ["run.yaml", "not valid YAML", "line "]),
    "yaml-not-a-mapping": ({"__text__": "- model\n- data\n"}, None, [], {}, ["run.yaml", "mapping"]),
    "unknown-section": ({"trainer": {"max_steps": 1}}, None, [], {}, ["trainer", "valid keys"]),
    "unknown-model-key": ({"model.weights": "x"}, None, [], {}, ["model.weights"]),
    "model-both": ({"model.name_or_path": "somewhere"}, None, [], {}, ["model.config", "model.name_or_path"]),
    "model-neither": ({"model.config": _DELETE}, None, [], {}, ["model.config", "model.name_or_path"]),
    "model-type-missing": ({"model.config": {"hidden_size": 8}}, None, [], {}, ["model.config", "model_type"]),
    "model-dtype": ({"model.dtype": "float8"}, None, [], {}, ["model.dtype", "float32"]),
    "model-path-missing": ({"model.config": _DELETE, "model.name_or_path": "./no/such/model"}, None, [], {},
                           ["model.name_or_path", "does not exist"]),
    "model-hub-id-not-cached": ({"model.config": _DELETE, "model.name_or_path": "no-org/no-such-model"}, None, [],
                                {"HF_HUB_OFFLINE": "1"}, ["model.name_or_path", "no-org/no-such-model", "cache"]),
    "tokenizer-missing": ({"model.tokenizer": "./no_tokenizer"}, None, [], {}, ["model.tokenizer", "no_tokenizer"]),
    "data-train-missing": ({"data.train": "nope.jsonl"}, None, [], {}, ["data.train", "nope.jsonl"]),
    "data-train-required": ({"data.train": _DELETE}, None, [], {}, ["data.train", "required"]),
    "data-max-length": ({"data.max_length": 1}, None, [], {}, ["data.max_length"]),
    "data-eval-fraction": ({"data.eval_fraction": 1.5}, None, [], {}, ["data.eval_fraction"]),
    "data-unknown-key": ({"data.shuffle": True}, None, [], {}, ["data.shuffle"]),
    "training-lr-word": ({"training.learning_rate": "fast"}, None, [], {}, ["training.learning_rate", "number"]),
    "training-max-steps-word": ({"training.max_steps": "lots"}, None, [], {}, ["training.max_steps", "integer"]),
    "training-flag-word": ({"training.bf16": "perhaps"}, None, [], {}, ["training.bf16"]),
    "training-unknown-key": ({"training.learning_rates": 0.1}, None, [], {}, ["training.learning_rates"]),
    "training-accelerator-key": ({"training.mindspeed_rope": True}, None, [], {}, ["training.mindspeed_rope",
                                                                                   "features"]),
    "features-value": ({"features.rope": "maybe"}, None, [], {}, ["rope", "maybe"]),
    "features-unknown": ({"features.turbo": True}, None, [], {}, ["features.turbo"]),
    "features-backend": ({"features.backend": "tpu"}, None, [], {}, ["backend", "tpu"]),
    "parallel-unknown": ({"parallel.pp": 2}, None, [], {}, ["parallel.pp"]),
    "parallel-size-vs-world": ({"parallel.dp_shard": 3}, None, [], {}, ["dp_shard", "3"]),
    "parallel-size-negative": ({"parallel.dp_shard": -2}, None, [], {}, ["dp_shard"]),
    "runtime-threads": ({"runtime.cpu_threads": 0}, None, [], {}, ["runtime.cpu_threads"]),
    "evaluation-unknown": ({"evaluation.prompts": 3}, None, [], {}, ["evaluation.prompts"]),
    # ---- data files
    "jsonl-malformed-row": ({}, f"{GOOD_ROW}\n{GOOD_ROW}\n{{\"prompt\": \"x\", \"completion\": }}\n", [], {},
                            ["train.jsonl:3", "not valid JSON"]),
    "jsonl-missing-field": ({}, f"{GOOD_ROW}\n{{\"prompt\": \"x\"}}\n", [], {}, ["train.jsonl:2", "completion"]),
    "jsonl-not-an-object": ({}, f"{GOOD_ROW}\n\n[1, 2]\n", [], {}, ["train.jsonl:3", "not an object"]),
    "jsonl-empty": ({}, "\n\n", [], {}, ["train.jsonl", "no examples"]),
    "jsonl-not-utf8": ({}, b"\xff\xfe{}\n", [], {}, ["train.jsonl", "UTF-8"]),
    # ---- the command line
    "override-type": ({}, None, ["--max_steps", "lots"], {}, ["max_steps", "lots"]),
    "override-unknown": ({}, None, ["--no_such_argument", "1"], {}, ["--no_such_argument"]),
    "resume-nothing": ({}, None, ["--resume_from_checkpoint"], {}, ["--resume_from_checkpoint", "output_dir"]),
    "resume-missing-path": ({}, None, ["--resume_from_checkpoint", "gone/checkpoint-3"], {},
                            ["--resume_from_checkpoint", "gone/checkpoint-3", "not a directory"]),
    # ---- environment variables and the accelerator config file they name
    "env-backend": ({}, None, [], {"MINDSPEED_HF_BACKEND": "tpu"}, ["MINDSPEED_HF_BACKEND", "tpu"]),
    "env-flag": ({}, None, [], {"MINDSPEED_HF_MEMORY_RECOMPUTE": "maybe"}, ["MINDSPEED_HF_MEMORY_RECOMPUTE"]),
    "env-size": ({}, None, [], {"MINDSPEED_HF_PARALLEL_DP_SHARD": "two"}, ["MINDSPEED_HF_PARALLEL_DP_SHARD"]),
    "env-config-missing": ({}, None, [], {"MINDSPEED_HF_CONFIG": "missing.yaml"}, ["missing.yaml"]),
    "env-config-syntax": ({}, "__config__:kernels:\n  rope: [true\n", [], {"MINDSPEED_HF_CONFIG": "accel.yaml"},
                          ["accel.yaml", "not valid YAML", "line"]),
    "env-config-unknown-key": ({}, "__config__:kernels:\n  ropes: true\n", [], {"MINDSPEED_HF_CONFIG": "accel.yaml"},
                               ["ropes"]),
}

if importlib.util.find_spec("deepspeed") is not None:  # DeepSpeed with our own parallelism (CI installs deepspeed)
    CASES["deepspeed-with-cp"] = ({"training.deepspeed": {"zero_optimization": {"stage": 2}}, "parallel.cp": 2}, None,
                                  [], {}, ["DeepSpeed", "TrainingArguments.deepspeed", "context parallelism",
                                           "drop one"])


@pytest.fixture
def no_model_built(monkeypatch):
    built = []
    monkeypatch.setattr(cli_train, "build_model", lambda *a, **k: built.append(a) or pytest.fail("model built"))
    return built


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_bad_input_is_one_line_naming_it(case, tmp_path, monkeypatch, capsys, no_model_built, restore_wiring):
    edits, data, argv, env, fragments = CASES[case]
    monkeypatch.chdir(tmp_path)
    for name in [n for n in list(os.environ) if n.startswith("MINDSPEED_HF_") and n != "MINDSPEED_HF_AUTO"]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    train_text = "\n".join([GOOD_ROW] * 20) + "\n"
    if isinstance(data, str) and data.startswith("__config__:"):
        (tmp_path / "accel.yaml").write_text(data[len("__config__:"):])
    elif data is not None:
        train_text = data
    (tmp_path / "train.jsonl").write_bytes(train_text if isinstance(train_text, bytes) else train_text.encode())
    if "__text__" in edits:
        text = edits["__text__"]
    else:
        run = _base()
        for dotted, value in edits.items():
            _set(run, dotted, value)
        text = yaml.safe_dump(run)
    (tmp_path / "run.yaml").write_text(text)
    monkeypatch.setenv("MINDSPEED_HF_AUTO", "1")  # a user's default (the suite runs with 0)
    mindspeed_hf.disable()  # the command enables the accelerator itself, after reading the environment
    rc = cli_main.main(["train", str(tmp_path / "run.yaml"), "--skip-quality-eval", *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("mindspeed-hf train: error:")]
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert not no_model_built


def test_there_are_at_least_thirty():
    assert len(CASES) >= 30


def test_debug_shows_the_traceback(tmp_path, monkeypatch):
    (tmp_path / "run.yaml").write_text("- not a mapping\n")
    with pytest.raises(ValueError, match="mapping"):
        cli_main.main(["train", str(tmp_path / "run.yaml"), "--debug"])


def test_hub_id_loads_from_the_local_cache_offline(tmp_path):
    """`model.name_or_path: org/name` is a hub id: from_pretrained finds it in the cache HF_HOME names, offline
    (a fresh process, so both huggingface_hub and transformers read HF_HOME / HF_HUB_OFFLINE as a user's would)."""
    import subprocess
    import sys

    import torch
    from child_runs import REPO, child_env
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    snapshot = tmp_path / "hf" / "hub" / "models--tiny-org--tiny-qwen3" / "snapshots" / ("0" * 40)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_RUN_DIR / "tokenizer")
    model = Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         vocab_size=len(tokenizer), num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=16))
    model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    run = _base()
    run["model"] = {"name_or_path": "tiny-org/tiny-qwen3"}
    run["data"]["train"] = str(tmp_path / "train.jsonl")
    (tmp_path / "train.jsonl").write_text(GOOD_ROW + "\n")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    check = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "from mindspeed_hf.recipes.run_config import load_run_config\n"
        "from mindspeed_hf.recipes.text import build_model, load_tokenizer\n"
        "spec = load_run_config(sys.argv[1]).model\n"
        "assert spec.name_or_path == spec.tokenizer == 'tiny-org/tiny-qwen3', spec\n"
        "loaded = build_model(spec, load_tokenizer(spec)).state_dict()\n"
        "reference = AutoModelForCausalLM.from_pretrained(sys.argv[2]).state_dict()\n"
        "assert loaded.keys() == reference.keys()\n"
        "assert all(torch.equal(loaded[k], reference[k]) for k in loaded)\n"
        "print('LOADED', len(loaded))\n")
    env = child_env(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", check, str(tmp_path / "run.yaml"), str(snapshot)], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "LOADED" in proc.stdout, proc.stderr[-3000:]


def test_a_rerun_over_another_runs_checkpoints_is_one_line_before_any_model(tmp_path, monkeypatch, capsys,
                                                                             no_model_built, restore_wiring):
    """The issue's rerun: a run saved checkpoints into `out`; the same command again (another process: nothing of
    this process started there) stops before any model is built, every file as it was."""
    import json

    from mindspeed_hf.parallel.checkpoint import mark_complete
    from mindspeed_hf.trainers import starting

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(starting, "_STARTED", set())
    for step in (10, 20):
        checkpoint = tmp_path / "out" / f"checkpoint-{step}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        mark_complete(str(checkpoint), global_step=step)
    before = {p: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()}
    (tmp_path / "train.jsonl").write_text("\n".join([GOOD_ROW] * 20) + "\n")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(_base()))
    monkeypatch.setenv("MINDSPEED_HF_AUTO", "1")
    mindspeed_hf.disable()
    rc = cli_main.main(["train", str(tmp_path / "run.yaml"), "--skip-quality-eval", "--learning_rate", "1e-2"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("mindspeed-hf train: error:")]
    assert rc == 2 and len(lines) == 1, err
    assert "output_dir out holds another run's checkpoints (checkpoint-20, checkpoint-10; the newest at step 20)" in \
        lines[0] and "--mindspeed_overwrite" in lines[0], lines[0]
    assert {p: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()} == before
    assert not no_model_built
