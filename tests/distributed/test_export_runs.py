"""`mindspeed-hf export` on the checkpoints of real sharded runs: a plain Trainer script (tensor_trainer_worker.py)
under torchrun with the sizes only from MINDSPEED_HF_CONFIG saves checkpoint-3 and, at the same step, save_model.
The command's export of checkpoint-3 loads with every tensor equal to save_model's directory (and, to 1e-5, to the
same 3 steps of plain Hugging Face in one process): dp_shard=2 (qwen3; the run's own background export with
`checkpoints: {export_hf: true}` too),
ep=2 (qwen3_moe, experts in transformers' fused layout), tp=2 (llama), HSDP 2 x 2 (4 ranks), and a LoRA run (the
adapter equal; merged, equal to PEFT's own merge_and_unload of the saved adapter)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import transformers
from child_runs import child_env, run_or_fail, run_trainer_worker

WORKER = Path(__file__).resolve().parent / "tensor_trainer_worker.py"
FIVE = int(transformers.__version__.split(".")[0]) >= 5
RUNS = {  # name: (family, dp, ranks, config, needs transformers 5)
    # checkpoints.export_hf: the run also exports checkpoint-3 itself, in the background
    "dp_shard2": ("qwen3", 2, 2, "parallel: {dp_shard: 2}\ncheckpoints: {export_hf: true}\n", False),
    "ep2": ("qwen3_moe", 2, 2, "parallel: {ep: 2}\n", True),
    "tp2": ("llama", 1, 2, "parallel: {tp: 2}\n", True),
    "hsdp2x2": ("llama", 4, 4, "parallel: {dp_replicate: 2, dp_shard: 2}\n", False),
}


def _export(checkpoint: Path, out: Path, *flags: str) -> Path:
    run_or_fail([sys.executable, "-m", "mindspeed_hf.cli.main", "export", str(checkpoint), str(out), *flags],
                child_env(), f"export {checkpoint.name}")
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:5]
    return max((a[k] - b[k]).abs().max().item() for k in b)


@pytest.mark.parametrize("name", list(RUNS))
def test_export_equals_save_model(tmp_path, name):
    from transformers import AutoModelForCausalLM

    family, dp, ranks, config, needs_five = RUNS[name]
    if needs_five and not FIVE:
        pytest.skip("expert / tensor parallelism under Trainer: transformers >= 5")
    run = run_trainer_worker(WORKER, tmp_path, name, "tp", "--family", family, "--dp", str(dp), "--save_steps", "3",
                             config=config, nproc=ranks)
    exported = _export(tmp_path / f"{name}.json.dir" / "checkpoint-3", tmp_path / "hf")
    saved = AutoModelForCausalLM.from_pretrained(run["saved"]).state_dict()
    got = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    assert _max_diff(got, saved) == 0
    if "export_hf" in config:
        background = AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}.json.dir" / "hf" / "checkpoint-3")
        assert _max_diff(background.state_dict(), saved) == 0
    # and against plain Hugging Face: the same 3 steps in one process, unsharded
    ref = run_trainer_worker(WORKER, tmp_path, f"reference_{name}", "reference", "--family", family)
    assert _max_diff(got, ref["params"]) <= 1e-5


def test_export_of_a_lora_run(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from tiny_models import tiny_model
    from transformers import AutoModelForCausalLM

    run = run_trainer_worker(WORKER, tmp_path, "lora", "tp", "--family", "qwen3", "--dp", "2", "--lora",
                             "--save_steps", "3", config="parallel: {dp_shard: 2}\n", nproc=2)
    checkpoint = tmp_path / "lora.json.dir" / "checkpoint-3"
    adapter = _export(checkpoint, tmp_path / "adapter")
    name = "adapter_model.safetensors"
    assert _max_diff(load_file(str(adapter / name)), load_file(str(Path(run["saved"]) / name))) == 0
    merged = _export(checkpoint, tmp_path / "merged", "--merge-lora")
    want = PeftModel.from_pretrained(tiny_model("qwen3", use_cache=False), run["saved"]).merge_and_unload()
    assert _max_diff(AutoModelForCausalLM.from_pretrained(merged).state_dict(), want.state_dict()) == 0
