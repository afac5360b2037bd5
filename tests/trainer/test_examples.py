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


def _same_losses(script: str, tmp_path, *extra: str) -> tuple[dict, dict]:
    """Run `script` (with `extra` arguments) without and with the accelerator; assert equal per-step losses (fp32,
    1e-5), that it learns, and that the baseline applied nothing; return both reports."""
    base_losses, base = _split(run_example(script, tmp_path, False, "--max_steps", STEPS, *extra))
    fast_losses, fast = _split(run_example(script, tmp_path, True, "--max_steps", STEPS, *extra))

    assert len(base_losses) == len(fast_losses) == int(STEPS)
    torch.testing.assert_close(torch.tensor(fast_losses, dtype=torch.float64),
                               torch.tensor(base_losses, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    assert base_losses[-1] < base_losses[0], "the run should learn something"
    assert not base["enabled"] and not any(base["report"]["kernels"].values())
    return base, fast


@pytest.mark.parametrize("script", ["sft_trainer.py", "sft_lora.py", "sft_trl.py"])
def test_same_losses_with_and_without_accelerator(script, tmp_path):
    _, fast = _same_losses(script, tmp_path)
    assert fast["enabled"]
    kernels = fast["report"]["kernels"]
    for op in KERNELS:
        assert kernels[op] > 0, f"{op} not applied in {script}: {fast['report']}"
    assert kernels["rms_norm"] == 17  # 4 layers x (input, post-attention, q_norm, k_norm) + final norm


def _vl_forward_takes_mm_token_types() -> bool:
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mindspeed_hf.recipes.vl_data import takes_mm_token_types

    return takes_mm_token_types(Qwen2_5_VLForConditionalGeneration)


@pytest.mark.skipif(not _vl_forward_takes_mm_token_types(),
                    reason="the VLM example needs transformers >= 5 (Qwen-VL forward with mm_token_type_ids)")
@pytest.mark.parametrize("trainer", ["hf", "trl"])
def test_vlm_example_same_losses_with_and_without_accelerator(trainer, tmp_path):
    _, fast = _same_losses("vlm/sft_vlm.py", tmp_path, "--trainer", trainer)
    assert fast["enabled"] and fast["report"]["model_type"] == "qwen2_5_vl"
    applied = {**fast["report"]["kernels"], **{f"vision {k}": n for k, n in
                                               fast["report"].get("vision_kernels", {}).items()}}
    for op in (*KERNELS, *(k for k in applied if k.startswith("vision "))):
        assert applied[op] > 0, f"{op} not applied to the VLM: {fast['report']}"


@pytest.mark.skipif(not _vl_forward_takes_mm_token_types(),
                    reason="the Omni example needs transformers >= 5 (its tiny config's rope_parameters)")
def test_omni_thinker_example_same_losses_with_and_without_accelerator(tmp_path):
    """examples/omni/sft_omni_thinker.py (audio + image + text rows): plain HF's losses, and the kernels of the text
    model, the vision tower and the audio tower applied."""
    _, fast = _same_losses("omni/sft_omni_thinker.py", tmp_path)
    report = fast["report"]
    assert fast["enabled"] and report["model_type"] == "qwen2_5_omni_thinker"
    for op in KERNELS:
        assert report["kernels"][op] > 0, f"{op} not applied to the thinker: {report}"
    assert report["vision_kernels"]["attention"] > 0 and report["audio_kernels"]["attention"] > 0, report
