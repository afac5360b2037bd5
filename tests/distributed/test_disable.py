"""disable() after a context-parallel and a tensor-parallel run in the same process: transformers' attention, mask and
experts registries and every attribute of its model modules, their classes, Trainer and TrainingArguments are as
before enable() (tests/distributed/disable_worker.py, 2 ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import transformers
from child_runs import child_env, run_or_fail, torchrun

WORKER = Path(__file__).resolve().parent / "disable_worker.py"


def test_disable_after_cp_and_tp_runs_restores_transformers(tmp_path):
    out = tmp_path / "disable.json"
    run_or_fail(torchrun(str(WORKER), "--out", str(out)), child_env(), "disable_worker")
    result = json.loads(out.read_text())
    want = {"cp": {"size": 2, "attention": "mindspeed_cp"}}
    if int(transformers.__version__.split(".")[0]) >= 5:  # tensor parallelism needs transformers >= 5
        want["tp"] = {"size": 2, "attention": "mindspeed"}
    assert result["ran"] == want
    assert result["changed"] == []
