"""`mindspeed-hf bench`: the same short training run without the accelerator (MINDSPEED_HF_AUTO=0, plain HF) and
with it, each in its own process so neither sees the other's patches, printed side by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

RUNS = (("baseline (plain HF)", "0"), ("mindspeed_hf", "1"))
MAX_ROWS = 20  # per-step loss rows printed


def run_one(config: str | None, auto: str, workdir: Path, steps: int, overrides: list[str]) -> dict[str, Any]:
    """One `mindspeed-hf train` in a subprocess; returns its metrics JSON."""
    name = "accelerated" if auto == "1" else "baseline"
    metrics = workdir / f"{name}.json"
    cmd = [sys.executable, "-m", "mindspeed_hf.cli.main", "train", *([config] if config else []),
           "--metrics-file", str(metrics), "--skip-quality-eval",
           "--output_dir", str(workdir / name), "--max_steps", str(steps), "--logging_steps", "1",
           "--save_strategy", "no", "--disable_tqdm", "true", *overrides]
    env = {**os.environ, "MINDSPEED_HF_AUTO": auto}
    print(f"[bench] {name}: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench: the {name} run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(metrics.read_text())


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def compare(base: dict[str, Any], fast: dict[str, Any]) -> str:
    """The side-by-side markdown table (plus the per-step losses)."""
    def ratio(a: float | None, b: float | None) -> str:
        return "n/a" if not a or b is None else f"{b / a:.2f}x"

    steps = sorted(set(base["losses"]) & set(fast["losses"]), key=int)
    diffs = [abs(base["losses"][s] - fast["losses"][s]) for s in steps]
    mib = 2**20
    rows = [
        ("tokens/s", _fmt(base["tokens_per_s"], ",.0f"), _fmt(fast["tokens_per_s"], ",.0f"),
         ratio(base["tokens_per_s"], fast["tokens_per_s"])),
        ("peak memory (MiB)", f"{base['peak_memory_bytes'] / mib:,.0f}", f"{fast['peak_memory_bytes'] / mib:,.0f}",
         ratio(base["peak_memory_bytes"], fast["peak_memory_bytes"])),
        ("train runtime (s)", f"{base['train_runtime_s']:.2f}", f"{fast['train_runtime_s']:.2f}",
         ratio(base["train_runtime_s"], fast["train_runtime_s"])),
        ("final loss", _fmt(base["losses"].get(steps[-1]) if steps else None, ".6f"),
         _fmt(fast["losses"].get(steps[-1]) if steps else None, ".6f"), ""),
        ("max per-step loss diff", "", f"{max(diffs):.2e}" if diffs else "n/a", ""),
        ("kernels", "none", fast.get("applied", ""), ""),
    ]
    lines = [f"## mindspeed-hf bench: {fast['model_type']} on {fast['device']}, {len(steps)} steps", "",
             f"| | {RUNS[0][0]} | {RUNS[1][0]} | ratio |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    lines += ["", "| step | baseline loss | mindspeed_hf loss | abs diff |", "|---|---|---|---|"]
    # Long runs: about MAX_ROWS evenly spaced steps, always the last one.
    stride = max(1, -(-len(steps) // MAX_ROWS))
    shown = [i for i in range(len(steps)) if i % stride == stride - 1 or i == len(steps) - 1]
    lines += [f"| {steps[i]} | {base['losses'][steps[i]]:.6f} | {fast['losses'][steps[i]]:.6f} | {diffs[i]:.2e} |"
              for i in shown]
    return "\n".join(lines)


def bench(config: str | None, steps: int = 20, overrides: list[str] | None = None,
          workdir: str | None = None) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Run both sides; returns (table, baseline metrics, accelerated metrics)."""
    with tempfile.TemporaryDirectory(prefix="mindspeed_bench_") as tmp:
        root = Path(workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        base, fast = (run_one(config, auto, root, steps, overrides or []) for _, auto in RUNS)
    return compare(base, fast), base, fast
