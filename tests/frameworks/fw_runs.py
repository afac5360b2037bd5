"""Running a framework's own command line twice, plain and with `import mindspeed_hf` in a sitecustomize, and
reading back its per-step losses and what our kernels did (tests/frameworks/hook/sitecustomize.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
HOOK = HERE / "hook"


def tiny_assets(out: Path) -> tuple[Path, Path]:
    """(model dir, data dir) from examples/frameworks/make_tiny.py, built once per directory."""
    sys.path.insert(0, str(REPO / "examples" / "frameworks"))
    try:
        import make_tiny
    finally:
        sys.path.pop(0)
    return make_tiny.make_model(out), make_tiny.make_data(out)


def framework_env(accelerated: bool, dump: Path | None = None, extra: dict | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINDSPEED_HF_") and k != "PYTHONPATH"}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_DISABLED="true", WANDB_MODE="disabled",
               DISABLE_VERSION_CHECK="1", TOKENIZERS_PARALLELISM="false", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    env.pop("FORCE_TORCHRUN", None)
    if accelerated:
        env["PYTHONPATH"] = str(HOOK)
        env["MINDSPEED_HF_KERNELS_TORCH_PATH"] = "fused"  # ours everywhere on the CPU: compared with HF's
        if dump is not None:
            env["MSHF_TEST_DUMP"] = str(dump)
    else:
        env["MINDSPEED_HF_AUTO"] = "0"  # in case the package is imported by something else: stay plain
    env.update(extra or {})
    return env


def npu_env(**extra: str) -> dict[str, str]:
    """What an accelerated framework run needs on the npu path without an NPU: the stand-in torch_npu on the path
    beside the hook, MINDSPEED_HF_BACKEND=npu, and the hook counting the stand-in's attention calls."""
    return {"PYTHONPATH": os.pathsep.join([str(HOOK), str(REPO / "tests" / "npu_standin")]),
            "MINDSPEED_HF_BACKEND": "npu", "MSHF_TEST_COUNT_NPU": "1", "DS_ACCELERATOR": "cpu", **extra}


def run(cmd: list[str], env: dict[str, str], cwd: Path, log: Path, timeout: int = 900) -> str:
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    text = log.read_text()
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{text[-6000:]}")
    return text


def losses_from_log_history(path: Path) -> list[float]:
    """Per-step training losses from a trainer_state.json (log_history) or a JSONL of log records (LLaMA-Factory's
    trainer_log.jsonl, ms-swift's logging.jsonl): records that carry a training `loss`, in order."""
    if path.suffix == ".json":
        records = json.loads(path.read_text())["log_history"]
    else:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [float(r["loss"]) for r in records if "loss" in r and "eval_loss" not in r and "train_loss" not in r]


def read_dump(path: Path) -> dict:
    return json.loads(path.read_text())


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) for x, y in zip(a, b))
