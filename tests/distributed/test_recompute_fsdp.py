"""Recompute under FSDP2 on 2 ranks (torchrun, gloo, CPU): selective and full recompute give loss and gradient
shards bitwise equal to the same sharded model without recompute, and match one process on the same global batch
(1e-5), with and without LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest
from child_runs import run_worker

WORKER = Path(__file__).resolve().parent / "recompute_worker.py"


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return run_worker(WORKER, tmp_path_factory.mktemp("recompute_fsdp") / "report.json")


@pytest.mark.parametrize("case", ["plain/selective", "plain/selective_all_parts", "plain/full", "lora/selective",
                                  "lora/selective_all_parts", "lora/full"])
def test_recompute_under_fsdp2_equals_no_recompute(report, case):
    result = report[case]
    assert result["grads"] > 0
    assert result["bitwise_equal_all_ranks"], result
    assert result["max_diff_vs_one_process"] <= 1e-5, result
