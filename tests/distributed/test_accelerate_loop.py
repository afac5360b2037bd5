"""A plain accelerate loop (examples/custom_loop.py: Accelerator, prepare, accelerator.backward; `import mindspeed_hf`
its only mindspeed_hf line) on 2 CPU ranks, sizes only from MINDSPEED_HF_CONFIG (or an `accelerate launch` config),
against one plain process (MINDSPEED_HF_AUTO=0) fed the same global batch: losses per step within 1e-5, the saved
weights too; under cp each rank's attention sees half the sequence, under dp_shard / tp / ep the parameters are
DTensor shards. save_state / kill -9 / load_state resumes exactly; a save killed before its COMPLETE marker is
refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from child_runs import REPO, child_env, run_or_fail, torchrun
from packaging.version import Version
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import mindspeed_hf
from mindspeed_hf.parallel.tensor import TP_MIN_TRANSFORMERS
from mindspeed_hf.releases.supported import EP_MIN_TRANSFORMERS

WORKER = Path(__file__).resolve().parent / "loop_worker.py"
RELEASE = Version(transformers.__version__)
STEPS = 4
TOL = 1e-5
SGD = ("--optimizer", "sgd", "--learning_rate", "0.5")  # the weights then follow the gradients (AdamW amplifies a
# 1e-7 gradient difference on a near-zero gradient into a step-sized one)


def _loop(root: Path, name: str, *loop_args: str, config: str | None = None, launch: str = "torchrun",
          expect_failure: bool = False, **env: str) -> dict:
    """The loop under the worker: one plain process (`config` None), else 2 ranks with the YAML text `config` as
    MINDSPEED_HF_CONFIG (launch "torchrun") or through `accelerate launch --config_file CONFIG` (launch
    "accelerate", `config` the file's path)."""
    out = root / f"{name}.json"
    cmd = [str(WORKER), "--out", str(out), "--", "--max_steps", str(STEPS), "--output_dir", str(root / name),
           *SGD, *loop_args]
    if config is None:
        launched, extra = [sys.executable, *cmd], {}
    elif launch == "accelerate":
        launched = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, *cmd]
        extra = {}
    else:
        (root / f"{name}.yaml").write_text(config)
        launched, extra = torchrun(*cmd), {"MINDSPEED_HF_CONFIG": str(root / f"{name}.yaml")}
    environment = child_env(auto=config is not None, **extra, **env)
    if expect_failure:
        proc = subprocess.run(launched, env=environment, cwd=REPO, capture_output=True, text=True, timeout=500)
        assert proc.returncode != 0, proc.stdout[-3000:]
        return {"output": proc.stdout + proc.stderr, "losses": _losses(out.with_suffix(".losses.jsonl"))}
    run_or_fail(launched, environment, name)
    ranks = sorted(root.glob(f"{name}.json.rank*"))
    return {**json.loads(out.read_text()), "ranks": [json.loads(p.read_text()) for p in ranks],
            "weights": root / name / "final" / "model.safetensors"}


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()] if path.exists() else []


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) > 0, (got, want)
    assert max(abs(a - b) for a, b in zip(got, want)) <= TOL, (got, want)


def _same_weights(got: Path, want: Path) -> None:
    a, b = load_file(str(got)), load_file(str(want))
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in b)
    assert worst <= TOL, worst


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("accelerate_loop")


@pytest.fixture(scope="module")
def reference(root) -> dict:
    """One plain process, 4 rows per step (what 2 ranks of 2 rows, or a cp / tp group of 4, train on)."""
    return _loop(root, "reference", "--batch_size", "4", "--save_model")


def test_context_parallel_equals_one_process(root, reference):
    run = _loop(root, "cp", "--batch_size", "4", "--save_model", config="parallel: {cp: 2}\n")
    _close(run["losses"], reference["losses"])
    _same_weights(run["weights"], reference["weights"])
    # blocks of 64 tokens: each rank's attention layers see 32, one process's 64
    assert [r["attention_lengths"] for r in run["ranks"]] == [[32], [32]]
    assert reference["ranks"][0]["attention_lengths"] == [64]


def test_fsdp2_through_accelerate_launch_equals_one_process(root, reference):
    run = _loop(root, "dp_shard", "--batch_size", "2", "--save_model", launch="accelerate",
                config=str(REPO / "examples" / "accelerate" / "cpu_fsdp2.yaml"))
    _close(run["losses"], reference["losses"])
    _same_weights(run["weights"], reference["weights"])
    placements = run["ranks"][0]["placements"]
    assert placements and all(p == ["Shard(dim=0)"] for p in placements.values()), placements


@pytest.mark.skipif(RELEASE < Version(TP_MIN_TRANSFORMERS), reason="tp is refused before transformers 5 (tp plans)")
def test_tensor_parallel_equals_one_process(root):
    want = _loop(root, "reference_untied", "--batch_size", "4", "--untied", "--save_model")
    run = _loop(root, "tp", "--batch_size", "4", "--untied", "--save_model", config="parallel: {tp: 2}\n")
    _close(run["losses"], want["losses"])
    _same_weights(run["weights"], want["weights"])
    assert run["ranks"][0]["placements"]["model.layers.0.self_attn.q_proj.weight"] == ["Shard(dim=0)"]


@pytest.mark.skipif(RELEASE < Version(EP_MIN_TRANSFORMERS), reason="ep is refused before transformers 5")
def test_expert_parallel_equals_one_process(root):
    want = _loop(root, "reference_moe", "--batch_size", "4", "--moe", "--save_model")
    run = _loop(root, "ep", "--batch_size", "2", "--moe", "--save_model", config="parallel: {ep: 2}\n")
    _close(run["losses"], want["losses"])
    _same_weights(run["weights"], want["weights"])
    experts = [p for name, p in run["ranks"][0]["placements"].items() if "experts" in name]
    assert experts and all(p and p[-1] == "Shard(dim=0)" for p in experts), run["ranks"][0]["placements"]


def test_kill_and_resume_equal_the_uninterrupted_run(root, reference):
    """dp_shard 2, save_state every 2 steps; rank 0 killed (-9) inside the save of step 4, after its shards and
    before its COMPLETE marker: loading step_4 is refused in one line; load_state(step_2) trains steps 3 and 4 as
    the uninterrupted run did."""
    config = "parallel: {dp_shard: 2}\n"
    crashed = _loop(root, "crash", "--batch_size", "2", "--save_state_steps", "2", config=config,
                    expect_failure=True, LOOP_KILL_IN_SAVE="step_4")
    _close(crashed["losses"], reference["losses"])  # steps 1-4 logged before the kill
    assert (root / "crash" / "step_2" / "COMPLETE").is_file()
    assert not (root / "crash" / "step_4" / "COMPLETE").exists()
    refused = _loop(root, "crash_refused", "--batch_size", "2", "--resume_from", str(root / "crash" / "step_4"),
                    config=config, expect_failure=True)
    said = f"load_state: {root / 'crash' / 'step_4'} is not a complete checkpoint (no COMPLETE marker"
    assert said in refused["output"], refused["output"][-3000:]
    resumed = _loop(root, "resumed", "--batch_size", "2", "--resume_from", str(root / "crash" / "step_2"),
                    config=config)
    assert resumed["steps"] == [3, 4]
    _close(resumed["losses"], reference["losses"][2:])
    # `mindspeed-hf export` reads a save_state directory: a model from_pretrained loads, every weight there
    exported = mindspeed_hf.export(root / "crash" / "step_2", root / "crash_step_2_hf")
    loaded = AutoModelForCausalLM.from_pretrained(exported)
    assert set(loaded.state_dict()) >= set(load_file(str(reference["weights"])))
    assert not any(name.startswith(("random_states", "scheduler")) for name in os.listdir(exported))
