"""ms-swift's own `swift sft` (full SFT of a tiny Qwen3 built from a config, a local messages JSONL, 8 steps, fp32,
CPU), plain and with `import mindspeed_hf` in a sitecustomize: per-step losses from its logging.jsonl agree to
1e-5 and the backbone kernels ran. ms-swift computes the loss in its own compute_loss (docs/frameworks.md), so the
fused loss does not run there by default; the second test tries the proposed adapter from the test's hook
(MSHF_TEST_SWIFT_FUSED) and checks that the fused loss then runs with the same losses.

Runs where ms-swift is installed; skipped elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("swift.trainers")

from fw_runs import framework_env, losses_from_log_history, max_diff, read_dump, run, tiny_assets  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("swift_assets"))


def _sft(tmp: Path, model: Path, data: Path, accelerated: bool, extra_env: dict | None = None):
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
           "--gradient_checkpointing", "false", "--output_dir", str(out), "--add_version", "false"]
    dump = tmp / f"{tag}_report.json"
    env = framework_env(accelerated, dump, {"HF_DATASETS_CACHE": str(tmp / f"{tag}_cache"), **(extra_env or {})})
    log = run(cmd, env, tmp, tmp / f"{tag}.log")
    losses = losses_from_log_history(out / "logging.jsonl")
    return losses, (read_dump(dump) if accelerated else {}), log


@pytest.fixture(scope="module")
def plain(assets, tmp_path_factory):
    model, data = assets
    return _sft(tmp_path_factory.mktemp("swift_plain"), model, data, accelerated=False)[0]


def test_swift_sft_matches_plain(assets, plain, tmp_path):
    model, data = assets
    fast, dump, _ = _sft(tmp_path, model, data, accelerated=True)
    assert len(plain) == 8, plain
    diff = max_diff(plain, fast)
    print(f"swift sft: max per-step loss difference {diff:.3g}")
    assert diff <= TOL, (plain, fast)
    ran = dump["report"]["ran"]
    for op in ("rms_norm", "rope", "swiglu", "attention"):
        assert ran.get(op, 0) > 0, (op, ran)
    assert dump["framework"] == "ms-swift"
    assert any("fused loss does not run" in note for note in dump["message"].split("; ")), dump["message"]


def test_swift_fused_loss_through_the_proposed_adapter(assets, plain, tmp_path):
    model, data = assets
    fast, dump, _ = _sft(tmp_path, model, data, accelerated=True, extra_env={"MSHF_TEST_SWIFT_FUSED": "1"})
    diff = max_diff(plain, fast)
    print(f"swift sft + adapter: max per-step loss difference {diff:.3g}")
    assert diff <= TOL, (plain, fast)
    assert dump["report"]["ran"].get("fused_linear_cross_entropy", 0) == 8, dump["report"]["ran"]
