"""Activation offload under FSDP2 on 2 ranks (torchrun, gloo, CPU), with and without recompute and LoRA: loss and
gradient shards bitwise equal to the same sharded model without offload, equal to one process on the same global
batch (1e-5); device memory really freed (FSDP2 reshards the layer parameters, offload its activations) and nothing
left after backward."""

from __future__ import annotations

from pathlib import Path

import pytest
from child_runs import run_worker

WORKER = Path(__file__).resolve().parent / "offload_worker.py"
CASES = [f"{kind}/{mode}" for kind in ("plain", "lora") for mode in ("offload", "offload+selective", "offload+full")]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return run_worker(WORKER, tmp_path_factory.mktemp("offload_fsdp") / "report.json")


@pytest.mark.parametrize("case", CASES)
def test_offload_under_fsdp2_equals_no_offload(report, case):
    result = report[case]
    assert result["grads"] > 0
    assert result["bitwise_equal_all_ranks"], result
    assert result["max_diff_vs_one_process"] <= 1e-5, result
    assert result["nothing_left_all_ranks"], result
    assert result["layer_classes"] == ["FSDPQwen3DecoderLayer"] and result["offload_layers"], result  # both
    if not case.endswith("full"):  # full: the one offloaded layer's input is the embedding output, kept
        assert result["peak_offloaded_bytes"] > 0, result
