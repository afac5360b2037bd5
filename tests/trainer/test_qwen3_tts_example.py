"""examples/qwen3_tts: the fine-tuning script runs unmodified from its YAML under mindspeed_hf (the losses of plain
HF, kernels reported); a few Trainer steps of the example objective (full weights, LoRA, bf16) give the same
per-step losses and weights with the accelerator as plain HF; bad YAML fails with one clear line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import one_thread, qwen_tts_missing, tiny_tts_model  # noqa: F401

if qwen_tts_missing():
    pytest.skip(qwen_tts_missing(), allow_module_level=True)

from child_runs import REPO  # noqa: E402
from conftest import run  # noqa: E402

import mindspeed_hf  # noqa: E402

EXAMPLE = REPO / "examples" / "qwen3_tts"
sys.path.insert(0, str(EXAMPLE))
from data import Collator, synthetic_rows, write_jsonl  # noqa: E402
from finetune import read_run, with_lora  # noqa: E402
from tts_loss import Qwen3TTSFinetune  # noqa: E402

STEPS = 3
pytestmark = pytest.mark.usefixtures("one_thread")



def _yaml(tmp_path: Path, name: str, **sections) -> Path:
    import yaml

    path = tmp_path / name
    path.write_text(yaml.safe_dump(sections))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("qwen3_tts")
    model = tiny_tts_model()
    model.save_pretrained(root / "ckpt")
    write_jsonl(str(root / "train.jsonl"), synthetic_rows(model.config, 12))
    return root


def test_script_runs_from_yaml(checkpoint, tmp_path):
    """The script under `import mindspeed_hf` logs the losses of the same training done here with plain HF."""
    training = dict(max_steps=STEPS, per_device_train_batch_size=4, optim="adamw_torch", learning_rate=1e-3,
                    logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0)
    config = _yaml(checkpoint, "run.yaml", model={"name_or_path": "ckpt"}, data={"train": "train.jsonl"},
                   losses_file="losses.jsonl",
                   accelerator={"backend": "torch", "kernels": {"torch_path": "fused"}},
                   training={"output_dir": str(tmp_path / "out"), **training})
    run([sys.executable, str(EXAMPLE / "finetune.py"), str(config)], auto=True)
    lines = [json.loads(line) for line in (checkpoint / "losses.jsonl").read_text().splitlines()]
    logged = [line["loss"] for line in lines if "loss" in line]
    plain, _ = _train(checkpoint, tmp_path / "plain", lora=False, bf16=False, **training)
    assert len(logged) == STEPS
    # Trainer logs losses rounded to 4 decimals
    torch.testing.assert_close(torch.tensor(logged), torch.tensor(plain), atol=6e-5, rtol=0)
    report = next(line for line in lines if "report" in line)
    assert report["enabled"] and report["report"]["kernels"] == {
        "rms_norm": 18, "rope": 4, "swiglu": 4, "attention": 4, "fused_linear_cross_entropy": 0, "experts": 0,
        "linear_attention": 0}


def _train(checkpoint: Path, tmp_path: Path, lora: bool, bf16: bool, **training) -> tuple[list[float], dict]:
    """STEPS Trainer steps of the example objective on the checkpoint's data; per-step losses (unrounded) and the
    trained parameters."""
    from transformers import Trainer, TrainingArguments

    model = tiny_tts_model()
    if lora:
        torch.manual_seed(1)
        model = with_lora(model, {"r": 4, "alpha": 8})
        with torch.no_grad():  # non-zero B so the adapters matter from the first step
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.05)
    module = Qwen3TTSFinetune(model)
    losses: list[float] = []
    module.register_forward_hook(lambda mod, args, kwargs, out: losses.append(out["loss"].item()), with_kwargs=True)
    settings = dict(max_steps=STEPS, per_device_train_batch_size=4, optim="sgd", learning_rate=0.2, seed=0,
                    save_strategy="no", disable_tqdm=True, use_cpu=True)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", remove_unused_columns=False, bf16=bf16,
                             **{**settings, **training})
    rows = [json.loads(line) for line in (checkpoint / "train.jsonl").read_text().splitlines() if line]
    Trainer(model=module, args=args, train_dataset=rows, data_collator=Collator(model.config)).train()
    trained = {n: p.detach().float().clone() for n, p in module.named_parameters() if p.requires_grad}
    return losses, trained


@pytest.mark.parametrize("lora,bf16,tol", [(False, False, 1e-5), (True, False, 1e-5), (False, True, 2e-2)],
                         ids=["full", "lora", "bf16"])
def test_trainer_steps_match_plain(checkpoint, tmp_path, lora, bf16, tol):
    plain_losses, plain = _train(checkpoint, tmp_path / "plain", lora, bf16)
    mindspeed_hf.enable()
    fast_losses, fast = _train(checkpoint, tmp_path / "fast", lora, bf16)
    assert len(plain_losses) == STEPS
    torch.testing.assert_close(torch.tensor(fast_losses), torch.tensor(plain_losses), atol=tol, rtol=tol)
    assert plain.keys() == fast.keys()
    if lora:
        assert plain and all("lora_" in name for name in plain)
    for name, value in plain.items():
        torch.testing.assert_close(fast[name], value, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("text,message", [
    ("model: {name_or_path: x}\ndata: {train: y}\noptimizer: {}\n", "unknown sections ['optimizer']"),
    ("data: {train: y}\n", "model.name_or_path is required"),
    ("model: {name_or_path: x, dtype: fp8}\ndata: {train: y}\n", "model.dtype 'fp8' is not valid"),
])
def test_bad_yaml_fails_with_one_line(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_run(str(path))


def test_shipped_yaml_is_valid():
    from mindspeed_hf.config import config_from_dict

    run = read_run(str(EXAMPLE / "qwen3_tts.yaml"))
    assert run["training"]["bf16"] and run["model"]["name_or_path"].startswith(str(EXAMPLE))
    assert config_from_dict(run["accelerator"]).kernels.attention
