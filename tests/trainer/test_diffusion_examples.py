"""examples/diffusion (text-to-image LoRA on Flux, text-to-video LoRA on Wan, in the shape of diffusers' official
scripts): the per-step losses with the accelerator (npu path, what `import mindspeed_hf` with
MINDSPEED_HF_BACKEND=npu gives) equal the plain diffusers run's (fp32, 1e-5), and the report shows the kernels ran.
In-process (the scripts' main), a few steps each."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import mindspeed_hf
from mindspeed_hf.config import config_from_dict

pytest.importorskip("diffusers")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "diffusion"


def _main(script: str):
    spec = importlib.util.spec_from_file_location(f"diffusion_example_{script}", EXAMPLES / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("script", ["train_text_to_image_lora", "train_text_to_video_lora"])
def test_example_same_losses_with_and_without_accelerator(script, tmp_path):
    main = _main(script)
    args = ["--max_train_steps", "3", "--num_examples", "8", "--train_batch_size", "2",
            "--gradient_accumulation_steps", "2"]
    plain = main([*args, "--losses_file", str(tmp_path / "plain.jsonl")])
    mindspeed_hf.enable(config_from_dict({"backend": "npu"}))
    fast = main([*args, "--losses_file", str(tmp_path / "fast.jsonl")])
    assert len(plain) == len(fast) == 3
    torch.testing.assert_close(torch.tensor(fast), torch.tensor(plain), atol=1e-5, rtol=1e-5)
    lines = [json.loads(line) for line in (tmp_path / "fast.jsonl").read_text().splitlines()]
    report = lines[-1]["report"]
    assert lines[-1]["enabled"] and report["implementations"]["attention"] == "npu:npu_fusion_attention"
    assert all(report["kernels"][op] > 0 for op in ("attention", "rope", "rms_norm")), report
    assert all(report["ran"][op] > 0 for op in ("attention", "rope", "rms_norm")), report
    base = json.loads((tmp_path / "plain.jsonl").read_text().splitlines()[-1])
    assert not base["enabled"] and not any(base["report"]["kernels"].values())
