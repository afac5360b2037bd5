"""ms-swift's own `swift sft` (full SFT of a tiny Qwen3 built from a config, a local messages JSONL, 8 steps, fp32,
CPU), plain and with `import mindspeed_hf` in a sitecustomize: per-step losses and token accuracies from its
logging.jsonl agree to 1e-5. ms-swift's compute_loss calls the model with the labels, so the fused loss runs (8 of 8
steps), and its token accuracy (`outputs.logits.argmax(-1)`) is read from the chunked pass: the logits are never
built. `--padding_free` (ms-swift accepts it only with a flash attention name) runs our attention under
kernels.take_flash_attention: on the npu path (the stand-in torch_npu) every attention call is one packed TND call,
as many as report() counts, and the losses equal the plain padded run's.

Runs where ms-swift is installed; skipped elsewhere."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("swift.trainers")

from fw_runs import framework_env, max_diff, npu_env, read_dump, run, tiny_assets  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("swift_assets"))


def _sft(tmp: Path, model: Path, data: Path, accelerated: bool, extra_env: dict | None = None,
         extra_args: tuple[str, ...] = ()):
    tag = "accelerated" if accelerated else "plain"
    out = tmp / tag
    cli = Path(sys.executable).with_name("swift")
    cmd = [str(cli), "sft", "--model", str(model), "--model_type", "qwen3", "--template", "qwen3_nothinking",
           "--use_hf", "true",
           "--dataset", str(data / "tiny_messages.jsonl"), "--split_dataset_ratio", "0", "--tuner_type", "full",
           "--torch_dtype", "float32", "--max_length", "64", "--max_steps", "8", "--per_device_train_batch_size", "4",
           "--gradient_accumulation_steps", "1", "--learning_rate", "1e-3", "--lr_scheduler_type", "constant",
           "--warmup_ratio", "0", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
           "--seed", "0", "--data_seed", "0", "--dataset_num_proc", "1", "--dataloader_num_workers", "0",
           "--gradient_checkpointing", "false", "--output_dir", str(out), "--add_version", "false", *extra_args]
    dump = tmp / f"{tag}_report.json"
    env = framework_env(accelerated, dump, {"HF_DATASETS_CACHE": str(tmp / f"{tag}_cache"), **(extra_env or {})})
    log = run(cmd, env, tmp, tmp / f"{tag}.log")
    records = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "loss" in r and "train_loss" not in r and "eval_loss" not in r]
    return steps, (read_dump(dump) if accelerated else {}), log


def _column(steps: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in steps]


@pytest.fixture(scope="module")
def plain(assets, tmp_path_factory):
    model, data = assets
    return _sft(tmp_path_factory.mktemp("swift_plain"), model, data, accelerated=False)[0]


def test_swift_sft_matches_plain(assets, plain, tmp_path):
    model, data = assets
    fast, dump, _ = _sft(tmp_path, model, data, accelerated=True)
    assert len(plain) == 8, plain
    for key in ("loss", "token_acc"):
        diff = max_diff(_column(plain, key), _column(fast, key))
        print(f"swift sft: max per-step {key} difference {diff:.3g}")
        assert diff <= TOL, (key, plain, fast)
    ran = dump["report"]["ran"]
    for op in ("rms_norm", "rope", "swiglu", "attention"):
        assert ran.get(op, 0) > 0, (op, ran)
    assert dump["framework"] == "ms-swift"
    assert ran["fused_linear_cross_entropy"] == 8, ran  # its compute_loss calls the model with the labels
    assert dump["logits_built"] == 0  # its token accuracy read the top-1 tokens from the chunked pass
    assert "does not run" not in (dump["message"] or "")


def test_swift_padding_free_runs_packed_attention_on_npu(assets, plain, tmp_path):
    model, data = assets
    env = npu_env(MINDSPEED_HF_KERNELS_TAKE_FLASH_ATTENTION="true")
    fast, dump, log = _sft(tmp_path, model, data, accelerated=True, extra_env=env,
                           extra_args=("--padding_free", "true", "--attn_impl", "flash_attn"))
    diff = max_diff(_column(plain, "loss"), _column(fast, "loss"))
    print(f"swift sft --padding_free (npu stand-in): max per-step loss difference {diff:.3g}")
    assert diff <= TOL, (plain, fast)
    report = dump["report"]
    assert report["attention_implementation"] == "mindspeed" and report["backend"] == "npu"
    calls = dump["npu_fusion_attention"]
    assert set(calls) == {"TND"} and calls["TND"] == report["ran"]["attention"] > 0, (calls, report["ran"])
