"""FSDP2 on 2 ranks (gloo, CPU) with a tiny Qwen2.5-VL accelerated by mindspeed_hf equals plain HF in one process:
full fine-tune (vision blocks and decoder layers as wrap units) and LoRA on the language model with the vision tower
frozen; LLaVA and InternVL with one rank's sample text only (its tower runs on a placeholder image) too. One torchrun
launch (vlm_fsdp_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from child_runs import run_worker

WORKER = Path(__file__).resolve().parent / "vlm_fsdp_worker.py"


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    return run_worker(WORKER, tmp_path_factory.mktemp("vlm_fsdp") / "out.json", nproc=2)


@pytest.mark.parametrize("recipe", ["full", "lora"])
def test_fsdp_vlm_equals_one_process(result, recipe):
    r = result[recipe]
    assert len(r["losses"]) == len(r["ref_losses"]) == 2
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert abs(got - want) <= 1e-5, (r["losses"], r["ref_losses"])
    assert r["grad_max_diff"] <= 1e-5 and r["grads"] == r["trainable"]  # every gradient, vision and text
    assert r["param_max_diff"] <= 1e-5  # after 2 SGD steps
    assert r["vision_kernels"]["attention"] == 2 and r["kernels"]["fused_linear_cross_entropy"] == 1
    if recipe == "lora":
        assert r["trainable"] == 2 * 2 * 3  # A and B of q/v/down in 2 layers: vision tower frozen


@pytest.mark.parametrize("model_type", ["llava", "internvl"])
def test_a_text_only_rank_beside_one_with_images_equals_one_process(result, model_type):
    r = result[model_type]
    assert r["placeholders"] == 2  # rank 1, both steps
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert abs(got - want) <= 1e-5, (r["losses"], r["ref_losses"])
    # the same parameters have gradients as in one process (LLaVA's last vision layer feeds nothing: none)
    assert r["grad_max_diff"] <= 1e-5 and r["grads"] >= r["trainable"] - 2
    assert r["param_max_diff"] <= 1e-5
