"""The same ZeRO-3 training as test_deepspeed.py, started by DeepSpeed's own launcher (`deepspeed --num_gpus 2`, which
passes `--local_rank` and its own environment) instead of torchrun: mindspeed_hf initialises deepspeed.comm and the
model is partitioned over both ranks; the losses equal plain DeepSpeed's (1e-5) and resume is exact. One launch
(about 35 s on 2 cores)."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
from child_runs import child_env, run_or_fail
from test_deepspeed import TOL, _assert_close

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install mindspeed_hf[deepspeed])")

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_zero3_under_the_deepspeed_launcher(tmp_path):
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(_free_port()),
           str(HERE / "deepspeed_worker.py"), "zero3", "--root", str(tmp_path), "--out", str(out)]
    run_or_fail(cmd, child_env(auto=True), "deepspeed launcher")
    result = json.loads(out.read_text())["zero3"]
    acc = result["accelerated"]
    assert acc["world_size"] == 2 and acc["zero_stage"] == 3 and acc["lm_head_numel"] == 0, acc
    assert acc["head_inputs"] and all(len(shape) == 2 for shape in acc["head_inputs"])
    _assert_close(acc["losses"], result["plain"]["losses"], TOL)
    assert result["resumed"]["losses"] == [losses[2:] for losses in acc["losses"]]
