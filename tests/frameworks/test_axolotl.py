"""axolotl's own `axolotl train` (full SFT of a tiny Qwen3 built from a config on local Alpaca rows, 8 steps, fp32,
CPU), plain and with `import mindspeed_hf` in a sitecustomize: per-step losses (its trainer_state.json) agree to 1e-5,
our kernels ran, the fused loss every step and no logits built. With `sample_packing: true` on the npu path (the
stand-in torch_npu): every attention call one packed TND call, as many as report() counts.

axolotl 0.19.0 is the newest release that installs on Python 3.11 (0.20 on need 3.12). Runs where axolotl is
installed (.ci/frameworks.sh with FW_AXOLOTL=1); skipped elsewhere."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("axolotl.cli")

from fw_runs import framework_env, losses_from_log_history, max_diff, npu_env, read_dump, run, tiny_assets  # noqa: E402

TOL = 1e-5
BASE = dict(
    model_type="AutoModelForCausalLM", tokenizer_type="AutoTokenizer", val_set_size=0, sequence_len=64,
    sample_packing=False, micro_batch_size=4, gradient_accumulation_steps=1, max_steps=8, num_epochs=1,
    optimizer="adamw_torch", learning_rate=1e-3, lr_scheduler="constant", warmup_steps=0, bf16=False, fp16=False,
    tf32=False, gradient_checkpointing=False, logging_steps=1, save_strategy="steps", save_steps=8, seed=0,
    dataloader_num_workers=0,
)
VARIANTS = {"full": {}, "sample_packing_npu": dict(sample_packing=True, pad_to_sequence_len=True)}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("axolotl_assets"))


def _train(tmp: Path, model: Path, data: Path, changes: dict, accelerated: bool, npu: bool):
    tag = "accelerated" if accelerated else "plain"
    out = tmp / tag
    config = {**BASE, **changes, "base_model": str(model), "output_dir": str(out),
              "dataset_prepared_path": str(tmp / f"{tag}_prepared"),
              "datasets": [{"path": str(data / "tiny_alpaca.json"), "ds_type": "json", "type": "alpaca"}]}
    cfg = tmp / f"{tag}.yml"
    cfg.write_text(json.dumps(config, indent=1))  # JSON is YAML
    dump = tmp / f"{tag}_report.json"
    bin_dir = str(Path(sys.executable).parent)  # axolotl execs `accelerate launch` from PATH
    env = framework_env(accelerated, dump, {"PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
                                            "HF_DATASETS_CACHE": str(tmp / f"{tag}_cache"), "DO_NOT_TRACK": "1",
                                            "AXOLOTL_DO_NOT_TRACK": "1",
                                            **(npu_env() if npu and accelerated else {})})
    log = run([str(Path(bin_dir) / "axolotl"), "train", str(cfg)], env, tmp, tmp / f"{tag}.log")
    losses = losses_from_log_history(out / "checkpoint-8" / "trainer_state.json")
    return losses, (read_dump(dump) if accelerated else {}), log


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_axolotl_train_matches_plain(variant, assets, tmp_path):
    model, data = assets
    npu = variant.endswith("_npu")
    plain, _, _ = _train(tmp_path, model, data, VARIANTS[variant], accelerated=False, npu=npu)
    fast, dump, log = _train(tmp_path, model, data, VARIANTS[variant], accelerated=True, npu=npu)
    assert len(plain) == 8, plain
    diff = max_diff(plain, fast)
    print(f"axolotl {variant}: max per-step loss difference {diff:.3g}")
    assert diff <= TOL, (plain, fast)
    ran = dump["report"]["ran"]
    for op in ("rms_norm", "rope", "swiglu", "attention"):
        assert ran.get(op, 0) > 0, (op, ran)
    assert dump["framework"] == "axolotl" and dump["conflicts"] == []
    assert ran["fused_linear_cross_entropy"] == 8 and dump["logits_built"] == 0, (ran, dump["logits_built"])
    if npu:
        calls = dump["npu_fusion_attention"]
        assert set(calls) == {"TND"} and calls["TND"] == ran["attention"], (calls, ran)
        assert "npu_fusion_attention cannot run" not in log
