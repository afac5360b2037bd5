"""benchmarks/gpu_check.sh dry-run on a machine without CUDA: it says it skips the CUDA steps, installs nothing,
runs the GPU benchmark's code with tiny shapes on the CPU (plain HF vs mindspeed_hf through Trainer on packed
rows, fp32: losses within 1e-5 of plain HF) and exits 0."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from child_runs import REPO, child_env


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: gpu_check.sh would run for real")
def test_gpu_check_dry_run_on_cpu(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=child_env(OUT=str(tmp_path), PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no CUDA device here: skipping the CUDA parity tests, the GPU benchmark and the offload benchmark" in (
        proc.stdout)
    assert not (tmp_path / "gpu_table.md").exists()
    table = (tmp_path / "gpu_table_dryrun.md").read_text()
    for shape in ("qwen3_0_6b", "qwen3_moe_30b_a3b_4layers"):
        assert f"### {shape} (tiny): fp32, 1 x 128 packed" in table
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| mindspeed_hf |")]
    assert len(rows) == 2
    for row in rows:
        assert float(row[2].replace(",", "")) > 0 and float(row[4]) > 0
        assert float(row[6]) <= 1e-5, row  # max per-step loss difference to plain HF
