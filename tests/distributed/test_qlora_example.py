"""examples/qlora/sft_qlora.py, an unmodified QLoRA script (4-bit NF4, double quant, gradient checkpointing,
prepare_model_for_kbit_training, PEFT LoRA, plain Trainer): per-step losses with the accelerator under torchrun with
FSDP2 on 2 ranks equal plain HF in one process on the same global batch, and the FSDP2 run saves the adapter only.
(One process with vs without the accelerator: tests/models/test_qlora.py.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (pip install -e .[qlora])")

from child_runs import REPO, child_env, run_or_fail, torchrun  # noqa: E402

SCRIPT = REPO / "examples" / "qlora" / "sft_qlora.py"
TOL = 1e-5


def _lines(path: Path) -> tuple[list[float], dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], next(r for r in rows if "report" in r)


def _run(tmp: Path, name: str, auto: bool, sharded: bool = False) -> tuple[list[float], dict]:
    out = tmp / f"{name}.jsonl"
    args = [str(SCRIPT), "--max_steps", "3", "--num_examples", "32", "--output_dir", str(tmp / name),
            "--losses_file", str(out)]
    if sharded:
        cmd = torchrun(*args, "--per_device_train_batch_size", "4", "--fsdp", "full_shard", "--fsdp_config",
                       '{"fsdp_version": 2}')
    else:
        cmd = [sys.executable, *args]
    run_or_fail(cmd, child_env(auto=auto), f"sft_qlora.py {name}")
    return _lines(out)


def _close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) == 3 and all(abs(x - y) <= TOL for x, y in zip(a, b)), (a, b)


def test_qlora_example_under_fsdp2_matches_plain_hf(tmp_path):
    """Plain HF in one process against the accelerated script under torchrun with FSDP2 (kernels, fused loss,
    recompute from gradient_checkpointing, the packed base weights sharded): the same per-step losses."""
    plain, plain_report = _run(tmp_path, "plain", auto=False)
    sharded, report = _run(tmp_path, "fsdp", auto=True, sharded=True)
    assert plain_report["enabled"] is False and report["enabled"] is True
    kernels = report["report"]["kernels"]
    assert kernels["fused_linear_cross_entropy"] == 1 and kernels["swiglu"] == 4 and kernels["rms_norm"] == 17
    assert report["report"]["quantized_linear"]["modules"] == 28
    _close(sharded, plain)
    saved = sorted(p.name for p in (tmp_path / "fsdp").iterdir())
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved
