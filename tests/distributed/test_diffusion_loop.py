"""diffusers-style LoRA loops (examples/diffusion: Flux text-to-image, Wan text-to-video; Accelerator, add_adapter,
prepare, flow matching) on 2 CPU ranks with the sizes only from MINDSPEED_HF_CONFIG, through the accelerate seam:
cp=2 (every rank's attention over half the image / video tokens) and dp_shard=2 each equal one plain-diffusers
process on the same global batch (per-step losses within 1e-5). Each example draws its noise from a generator of its
own (--noise_per_example), so the processes draw what one process draws."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from child_runs import REPO, child_env, run_or_fail, torchrun

pytest.importorskip("diffusers")

WORKER = Path(__file__).resolve().parent / "loop_worker.py"
SCRIPTS = {"flux": REPO / "examples/diffusion/train_text_to_image_lora.py",
           "wan": REPO / "examples/diffusion/train_text_to_video_lora.py"}
TOL = 1e-5


def _run(root: Path, family: str, name: str, batch: int, config: str | None = None) -> dict:
    out = root / f"{family}_{name}.json"
    cmd = [str(WORKER), "--out", str(out), "--script", str(SCRIPTS[family]), "--", "--max_train_steps", "3",
           "--train_batch_size", str(batch), "--noise_per_example", "--num_examples", "16"]
    if config is None:
        run_or_fail([sys.executable, *cmd], child_env(), f"{family} {name}")
    else:
        (root / f"{family}_{name}.yaml").write_text(config)
        run_or_fail(torchrun(*cmd), child_env(auto=True, MINDSPEED_HF_CONFIG=str(root / f"{family}_{name}.yaml")),
                    f"{family} {name}")
    ranks = sorted(root.glob(f"{out.name}.rank*"))
    return {**json.loads(out.read_text()), "ranks": [json.loads(p.read_text()) for p in ranks]}


@pytest.mark.parametrize("family", sorted(SCRIPTS))
def test_diffusion_lora_loop_over_cp_and_fsdp2_equals_one_process(family, tmp_path):
    reference = _run(tmp_path, family, "reference", batch=4)
    cp = _run(tmp_path, family, "cp", batch=4, config="parallel: {cp: 2}\n")
    fsdp = _run(tmp_path, family, "dp_shard", batch=2, config="parallel: {dp_shard: 2}\n")
    for run in (cp, fsdp):
        assert len(run["losses"]) == len(reference["losses"]) == 3
        assert max(abs(a - b) for a, b in zip(run["losses"], reference["losses"])) <= TOL, (run, reference)
    whole = reference["ranks"][0]["attention_lengths"]
    assert whole and [r["attention_lengths"] for r in cp["ranks"]] == [[n // 2 for n in whole]] * 2, (whole, cp)
    assert all(r["attention_lengths"] == whole for r in fsdp["ranks"])
    sharded, total = fsdp["ranks"][0]["dtensor_params"]
    assert total > 0 and sharded == total, fsdp["ranks"][0]  # every parameter (frozen base, LoRA) a DTensor shard
    assert reference["ranks"][0]["dtensor_params"][0] == 0
