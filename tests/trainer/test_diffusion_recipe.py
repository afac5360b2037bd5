"""`mindspeed-hf train --recipe diffusion`: the embedded text-to-image LoRA run learns (the held-out flow-matching
loss falls), its kernels ran, and it writes a checkpoint FluxTransformer2DModel.from_pretrained loads with the
adapters fused in (the loaded model gives the trained model's prediction)."""

import json
import os

import pytest
import torch
from conftest import REPO, cli

pytest.importorskip("diffusers")


def test_recipe_learns_and_writes_a_loadable_checkpoint(tmp_path):
    from diffusers import FluxTransformer2DModel

    from mindspeed_hf.recipes import diffusion_data as data
    from mindspeed_hf.recipes.diffusion import LATENT, N_EVAL, held_out_loss

    metrics = tmp_path / "metrics.json"
    cli(["train", "--recipe", "diffusion", "--max_steps", "60", "--output_dir", str(tmp_path / "out"),
         "--metrics-file", str(metrics)], MINDSPEED_HF_BACKEND="npu",
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests" / "npu_standin")]))
    result = json.loads(metrics.read_text())
    assert result["after"]["eval_loss"] < 0.8 * result["before"]["eval_loss"], result
    assert result["report"]["implementations"]["attention"] == "npu:npu_fusion_attention"
    assert all(result["report"]["ran"][op] > 0 for op in ("attention", "rope", "rms_norm"))
    loaded = FluxTransformer2DModel.from_pretrained(str(tmp_path / "out"))
    assert not any("lora" in name for name, _ in loaded.named_parameters())
    loss = held_out_loss(loaded, data.dataset(N_EVAL, LATENT, offset=1), torch.device("cpu"))
    assert loss == pytest.approx(result["after"]["eval_loss"], rel=1e-4)


def test_recipe_takes_no_config(tmp_path):
    out = cli(["train", "x.yaml", "--recipe", "diffusion"], check=False)
    assert out.returncode == 2 and "--recipe diffusion builds its own model" in out.stderr
