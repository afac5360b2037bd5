"""Qwen3-TTS fine-tuning (the examples/qwen3_tts objective) under Trainer with FSDP2 on 2 ranks (gloo, CPU) and
mindspeed_hf's kernels equals one plain-HF process on the same global batch: per-step losses and the parameters
after the last step (fp32, 1e-5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from child_runs import run_worker
from tiny_models import qwen_tts_missing

if qwen_tts_missing():
    pytest.skip(qwen_tts_missing(), allow_module_level=True)

WORKER = Path(__file__).resolve().parent / "qwen3_tts_worker.py"


def test_fsdp2_two_ranks_match_one_process(tmp_path):
    plain = run_worker(WORKER, tmp_path / "plain.json", "plain", nproc=0)
    fsdp = run_worker(WORKER, tmp_path / "fsdp.json", "fsdp", nproc=2)
    assert fsdp["dtensor"] and not plain["dtensor"]
    assert fsdp["kernels"]["rms_norm"] == 18 and fsdp["kernels"]["rope"] == 4 and fsdp["kernels"]["attention"] == 4
    assert len(plain["losses"]) == len(fsdp["losses"]) == 3
    torch.testing.assert_close(torch.tensor(fsdp["losses"]), torch.tensor(plain["losses"]), atol=1e-5, rtol=1e-5)
    expected, got = torch.load(tmp_path / "plain.json.pt"), torch.load(tmp_path / "fsdp.json.pt")
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert plain["moved"] > 1e-3 and fsdp["moved"] > 1e-3  # the steps really trained
