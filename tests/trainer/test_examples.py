"""The example scripts (plain Trainer, Trainer + PEFT LoRA, TRL SFTTrainer) with `import mindspeed_hf` give the
same per-step losses as the same script with MINDSPEED_HF_AUTO=0 (fp32, 1e-5), and the report shows the kernels
really ran."""

from __future__ import annotations

import pytest
import torch
from conftest import run_example

STEPS = "5"
KERNELS = ("rms_norm", "rope", "swiglu", "attention", "fused_linear_cross_entropy")


def _split(lines: list[dict]) -> tuple[list[float], dict]:
    losses = [line["loss"] for line in lines if "loss" in line]
    report = next(line for line in lines if "report" in line)
    return losses, report


@pytest.mark.parametrize("script", ["sft_trainer.py", "sft_lora.py", "sft_trl.py"])
def test_same_losses_with_and_without_accelerator(script, tmp_path):
    base_losses, base = _split(run_example(script, tmp_path, False, "--max_steps", STEPS))
    fast_losses, fast = _split(run_example(script, tmp_path, True, "--max_steps", STEPS))

    assert len(base_losses) == len(fast_losses) == int(STEPS)
    torch.testing.assert_close(torch.tensor(fast_losses, dtype=torch.float64),
                               torch.tensor(base_losses, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    assert base_losses[-1] < base_losses[0], "the run should learn something"

    assert not base["enabled"] and not any(base["report"]["kernels"].values())
    assert fast["enabled"]
    kernels = fast["report"]["kernels"]
    for op in KERNELS:
        assert kernels[op] > 0, f"{op} not applied in {script}: {fast['report']}"
    assert kernels["rms_norm"] == 17  # 4 layers x (input, post-attention, q_norm, k_norm) + final norm
