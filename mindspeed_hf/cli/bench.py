"""`mindspeed-hf bench`: the same short training run without the accelerator (MINDSPEED_HF_AUTO=0, plain HF) and
with it, each in its own process so neither sees the other's patches, in interleaved pairs (A B, B A, A B, ...),
so that load from other work on the machine hits both sides alike. Each figure is printed as the median of the
per-pair ratios with their min..max spread, and a verdict only where every pair's ratio lies beyond 1 +- MARGIN.
The first step of every run (one-time costs) is outside tokens/s.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

RUNS = (("baseline (plain HF)", "0"), ("mindspeed_hf", "1"))
MAX_ROWS = 20  # per-step loss rows printed
MARGIN = 0.02  # a verdict needs every pair's ratio beyond 1 +- MARGIN
#: figure -> (metrics key, better when larger, format)
FIGURES = {"tokens/s": ("tokens_per_s", True, ",.0f"), "train runtime (s)": ("train_runtime_s", False, ".2f"),
           "peak memory (MiB)": ("peak_memory_bytes", False, ",.0f")}


def run_one(config: str | None, auto: str, workdir: Path, steps: int, overrides: list[str],
            tag: str = "") -> dict[str, Any]:
    """One `mindspeed-hf train` in a subprocess; returns its metrics JSON."""
    name = ("accelerated" if auto == "1" else "baseline") + tag
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


def _value(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    return None if value is None else float(value) / (2**20 if key == "peak_memory_bytes" else 1)


def _ratio_row(name: str, bases: list[dict[str, Any]], fasts: list[dict[str, Any]]) -> tuple[str, ...]:
    key, larger_is_better, spec = FIGURES[name]
    pairs = [(_value(b, key), _value(f, key)) for b, f in zip(bases, fasts, strict=True)]
    ratios = [f / b for b, f in pairs if b and f is not None]
    base = statistics.median(b for b, _ in pairs if b is not None) if pairs else None
    fast = statistics.median(f for _, f in pairs if f is not None) if pairs else None
    if not ratios:
        return name, _fmt(base, spec), _fmt(fast, spec), "n/a", "", ""
    low, high = min(ratios), max(ratios)
    if low > 1 + MARGIN or high < 1 - MARGIN:
        verdict = "better" if (low > 1) == larger_is_better else "worse"
    else:
        verdict = f"no clear difference (within {MARGIN:.0%}, or the spread straddles it)"
    spread = f"{low:.2f}..{high:.2f}" if len(ratios) > 1 else "one pair: no spread"
    return name, _fmt(base, spec), _fmt(fast, spec), f"{statistics.median(ratios):.2f}x", spread, verdict


def compare(bases: list[dict[str, Any]], fasts: list[dict[str, Any]]) -> str:
    """The side-by-side markdown table of paired runs (medians, the median per-pair ratio and its spread), then
    the per-step losses of the first pair and the largest loss difference of any pair."""
    base, fast = bases[0], fasts[0]
    steps = sorted(set(base["losses"]) & set(fast["losses"]), key=int)
    diffs = [abs(base["losses"][s] - fast["losses"][s]) for s in steps]
    worst = max((abs(b["losses"][s] - f["losses"][s]) for b, f in zip(bases, fasts, strict=True)
                 for s in set(b["losses"]) & set(f["losses"])), default=None)
    rows = [_ratio_row(name, bases, fasts) for name in FIGURES]
    rows += [("max per-step loss diff", "", _fmt(worst, ".2e"), "", "", ""),
             ("kernels", "none", fast.get("applied", ""), "", "", "")]
    lines = [f"## mindspeed-hf bench: {fast['model_type']} on {fast['device']}, {len(steps)} steps, "
             f"{len(bases)} interleaved pair(s)", "",
             f"| | {RUNS[0][0]} (median) | {RUNS[1][0]} (median) | ratio (median) | ratio spread (min..max) | "
             "verdict |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", "| step | baseline loss | mindspeed_hf loss | abs diff |", "|---|---|---|---|"]
    # Long runs: about MAX_ROWS evenly spaced steps, always the last one.
    stride = max(1, -(-len(steps) // MAX_ROWS))
    shown = [i for i in range(len(steps)) if i % stride == stride - 1 or i == len(steps) - 1]
    lines += [f"| {steps[i]} | {base['losses'][steps[i]]:.6f} | {fast['losses'][steps[i]]:.6f} | {diffs[i]:.2e} |"
              for i in shown]
    return "\n".join(lines)


def bench(config: str | None, steps: int = 20, overrides: list[str] | None = None, workdir: str | None = None,
          repeats: int = 3) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """Run `repeats` interleaved pairs (A B, B A, ...); returns (table, baseline metrics, accelerated metrics)."""
    if repeats < 1:
        raise ValueError(f"--repeats={repeats} must be >= 1")
    bases, fasts = [], []
    with tempfile.TemporaryDirectory(prefix="mindspeed_bench_") as tmp:
        root = Path(workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        for i in range(repeats):
            order = RUNS if i % 2 == 0 else RUNS[::-1]
            done = {auto: run_one(config, auto, root, steps, overrides or [], tag=f"_{i}") for _, auto in order}
            bases.append(done["0"])
            fasts.append(done["1"])
    return compare(bases, fasts), bases, fasts
