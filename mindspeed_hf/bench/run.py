"""`mindspeed-hf bench`: the same short training run without the accelerator (MINDSPEED_HF_AUTO=0, plain HF) and
with it, each in its own process so neither sees the other's patches, in interleaved pairs (A B, B A, A B, ...),
so that load from other work on the machine hits both sides alike. Each figure is printed as the median of the
per-pair ratios with their min..max spread, and a verdict only where every pair's ratio lies beyond 1 +- MARGIN
(and there are at least MIN_PAIRS pairs: with fewer the spread is unknown, and nothing is judged).
The first step of every run (one-time costs) is outside tokens/s; the median-step figures (bench_child) are what
bursts of other work on the machine move least. Then one counted step of each side (bench_counts: operators
dispatched, torch_npu calls, bytes saved for backward, largest tensor: deterministic, independent of load), and
with --profile a trace of a few accelerated steps (bench_profile); --plot draws it all (bench_plot).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUNS = (("baseline (plain HF)", "0"), ("mindspeed_hf", "1"))
MAX_ROWS = 20  # per-step loss rows printed
MARGIN = 0.02  # a verdict needs every pair's ratio beyond 1 +- MARGIN
MIN_PAIRS = 3  # fewer pairs give no spread worth judging: no verdict
#: figure -> (metrics key, better when larger, format)
FIGURES = {"tokens/s, median step": ("step_tokens_per_s", True, ",.0f"),
           "step time (ms), median step": ("step_time_ms", False, ".1f"),
           "host CPU time per step (ms), median step": ("step_host_ms", False, ".1f"),
           "tokens/s": ("tokens_per_s", True, ",.0f"), "train runtime (s)": ("train_runtime_s", False, ".2f"),
           "peak memory (MiB)": ("peak_memory_bytes", False, ",.0f")}


def _run_side(name: str, cmd: list[str], auto: str, stage: str = "bench") -> None:
    """Run one side's subprocess (MINDSPEED_HF_AUTO=auto); a failure raises with the end of its stderr."""
    print(f"[{stage}] {name}: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, env={**os.environ, "MINDSPEED_HF_AUTO": auto}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench: the {name} run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def run_one(config: str | None, auto: str, workdir: Path, steps: int, overrides: list[str],
            tag: str = "") -> dict[str, Any]:
    """One timed `train` run (bench_child timed) in a subprocess; returns its metrics JSON."""
    name = ("accelerated" if auto == "1" else "baseline") + tag
    metrics = workdir / f"{name}.json"
    _run_side(name, [sys.executable, "-m", "mindspeed_hf.bench.child", "timed", *([config] if config else []),
                     "--out", str(metrics), "--output_dir", str(workdir / name), "--max_steps", str(steps),
                     "--logging_steps", "1", "--save_strategy", "no", "--disable_tqdm", "true", *overrides], auto)
    return json.loads(metrics.read_text())


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _value(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    return None if value is None else float(value) / (2**20 if key == "peak_memory_bytes" else 1)


def ratio_stats(name: str, bases: list[dict[str, Any]], fasts: list[dict[str, Any]]) -> tuple[float, ...] | None:
    """(median, min, max) of the per-pair accelerated/baseline ratios of figure `name`; None when none exists."""
    key = FIGURES[name][0]
    ratios = [f / b for b, f in ((_value(b, key), _value(f, key)) for b, f in zip(bases, fasts, strict=True))
              if b and f is not None]
    return (statistics.median(ratios), min(ratios), max(ratios)) if ratios else None


def _ratio_row(name: str, bases: list[dict[str, Any]], fasts: list[dict[str, Any]]) -> tuple[str, ...]:
    key, larger_is_better, spec = FIGURES[name]
    base_values = [v for v in (_value(b, key) for b in bases) if v is not None]
    fast_values = [v for v in (_value(f, key) for f in fasts) if v is not None]
    base = statistics.median(base_values) if base_values else None
    fast = statistics.median(fast_values) if fast_values else None
    stats = ratio_stats(name, bases, fasts)
    if stats is None:
        return name, _fmt(base, spec), _fmt(fast, spec), "n/a", "", ""
    median, low, high = stats
    spread = f"{low:.2f}..{high:.2f}" if len(bases) > 1 else "one pair: no spread"
    verdict = _verdict(low, high, larger_is_better, len(bases))
    return name, _fmt(base, spec), _fmt(fast, spec), f"{median:.2f}x", spread, verdict


def _verdict(low: float, high: float, larger_is_better: bool, pairs: int) -> str:
    """better / worse only when at least MIN_PAIRS pairs all lie beyond 1 +- MARGIN; fewer pairs: not judged."""
    if pairs < MIN_PAIRS:
        return f"not judged: {pairs} pair(s), spread unknown (--repeats {MIN_PAIRS} or more for a verdict)"
    if low > 1 + MARGIN or high < 1 - MARGIN:
        return "better" if (low > 1) == larger_is_better else "worse"
    return f"no clear difference (within {MARGIN:.0%}, or the spread straddles it)"


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
    if fast.get("device") == "cpu" and (fast.get("report") or {}).get("backend") == "torch":
        lines += ["", CPU_NOTE]
    return "\n".join(lines)


CPU_NOTE = ("On a CPU the accelerated side runs the torch backend: HF's own code for the ops where ours gains "
            "nothing there (report()['hf_path']), ours where it pays (rotary embeddings, attention with shared "
            "key/value heads, the chunked loss of a large vocabulary); kernels.torch_path: fused runs ours "
            "everywhere, the correctness reference. No speed-up is expected beyond those; the host time per step is "
            "what the accelerator's own Python costs, which on an NPU or a GPU sits between kernel launches.")


#: per-step proxy -> (counts key, scale, format); see bench_counts
PROXIES = {"kernels dispatched (aten + torch_npu)": (None, 1, ",.0f"), "aten operators": ("aten_ops", 1, ",.0f"),
           "torch_npu kernel calls (fwd + bwd)": ("npu_calls", 1, ",.0f"),
           "saved for backward (MiB)": ("saved_bytes", 2**20, ",.2f"),
           "largest tensor allocated (MiB)": ("largest_alloc_bytes", 2**20, ",.2f")}


def proxy_value(counts: dict[str, Any], name: str) -> float:
    """One per-step proxy of a counted run (bench_counts), in the unit PROXIES gives it."""
    key, scale, _ = PROXIES[name]
    return (counts["aten_ops"] + counts["npu_calls"]) if key is None else counts[key] / scale


def count_table(base: dict[str, Any], fast: dict[str, Any]) -> str:
    """The device-independent proxies of one counted training step (forward + backward + optimizer) of each side,
    with their ratios: the same code gives the same numbers on any machine."""
    lines = ["## per training step, counted (deterministic: independent of machine load)", "",
             f"| | {RUNS[0][0]} | {RUNS[1][0]} | ratio |", "|---|---|---|---|"]
    for name, (_, _, spec) in PROXIES.items():
        b, f = proxy_value(base, name), proxy_value(fast, name)
        lines.append(f"| {name} | {b:{spec}} | {f:{spec}} | {f'{f / b:.2f}x' if b else 'n/a'} |")
    if fast["npu_calls"] and "npu_standin" in str(fast.get("torch_npu")):
        lines += ["", "torch_npu here is the CPU stand-in: each call and its backward count as one kernel, but its "
                      "saved bytes are those of its reference math, not the device kernel's."]
    return "\n".join(lines)


def run_counts(config: str | None, auto: str, workdir: Path, overrides: list[str],
               profile: str | None = None) -> dict[str, Any]:
    """The counted run (bench_counts) of one side in a subprocess, optionally profiling a few more steps."""
    name = ("accelerated" if auto == "1" else "baseline") + "_counted"
    out = workdir / f"{name}.json"
    _run_side(name, [sys.executable, "-m", "mindspeed_hf.bench.child", "counted", *([config] if config else []),
                     "--out", str(out), *(["--profile", profile] if profile else []),
                     "--output_dir", str(workdir / name), *overrides], auto, stage="bench counted")
    return json.loads(out.read_text())


@dataclass
class BenchResult:
    """What `bench` measured: the paired timed runs' metrics, each side's counted step, the printed report."""

    bases: list[dict[str, Any]]
    fasts: list[dict[str, Any]]
    counts: dict[str, dict[str, Any]]  # "baseline" / "accelerated" -> bench_counts output
    report: str


def check_options(repeats: int, backend: str | None, steps: int = 1) -> None:
    """Bad bench options fail here, before any run: one line naming the option and the valid choices."""
    if steps < 1:
        raise ValueError(f"--steps={steps} must be >= 1 (training steps per side)")
    if repeats < 1:
        raise ValueError(f"--repeats={repeats} must be >= 1")
    if backend is not None:
        from ..ops.registry import validate_backend_name

        validate_backend_name(backend.lower(), "--backend")


def bench(config: str | None, steps: int = 20, overrides: list[str] | None = None, workdir: str | None = None,
          repeats: int = 3, backend: str | None = None, profile: str | None = None) -> BenchResult:
    """Run `repeats` interleaved pairs (A B, B A, ...), then one counted step of each side (and, with `profile`,
    a trace of a few accelerated steps into that directory). `backend` forces the accelerated side's kernels."""
    check_options(repeats, backend, steps)
    common = list(overrides or [])
    sides = {"0": common, "1": [*common, *(["--mindspeed_backend", backend.lower()] if backend else [])]}
    bases, fasts = [], []
    with tempfile.TemporaryDirectory(prefix="mindspeed_bench_") as tmp:
        root = Path(workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        for i in range(repeats):
            order = RUNS if i % 2 == 0 else RUNS[::-1]
            done = {auto: run_one(config, auto, root, steps, sides[auto], tag=f"_{i}") for _, auto in order}
            bases.append(done["0"])
            fasts.append(done["1"])
        counts = {"baseline": run_counts(config, "0", root, sides["0"]),
                  "accelerated": run_counts(config, "1", root, sides["1"], profile=profile)}
    report = compare(bases, fasts) + "\n\n" + count_table(counts["baseline"], counts["accelerated"])
    if profile:
        from .profile import TRACE_NAME, top_ops

        report += "\n\n" + top_ops(Path(profile) / TRACE_NAME)
    return BenchResult(bases, fasts, counts, report)
