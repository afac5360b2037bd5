"""What the benchmark scripts share: print a result and write it where --out says."""

from __future__ import annotations

from pathlib import Path


def emit(text: str, out: str | None) -> None:
    """Print `text` (markdown) and, with `out`, write it there (creating the folder)."""
    print(text, flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)


def add_run_arguments(parser) -> None:
    """--dtype, --device, --out and the hidden --worker flag of the scripts that time plain HF against mindspeed_hf
    in child processes of themselves."""
    import argparse

    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--device", default=None, help="cpu, cuda or npu (default: what is here)")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def spread(values: list[float]) -> str:
    """`median x [min-max]` of ratios measured over several process pairs."""
    import statistics

    return f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"


def paired_rows(runs: list[dict[str, dict]], names: tuple[str, str] = ("plain HF", "mindspeed_hf")) -> list[str]:
    """Markdown rows for process pairs `runs` (each {name: {"step", "peak_bytes", "losses"}}): per name the median
    step time and peak over the pairs and the first pair's losses, then the ratio line (second name over first)."""
    import statistics

    base, ours = names
    lines = ["| run | step time (s, median of pairs) | peak memory (MB, median of pairs) | losses (first pair) |",
             "|---|---|---|---|"]
    for name in names:
        step = statistics.median(r[name]["step"] for r in runs)
        peak = statistics.median(r[name]["peak_bytes"] for r in runs) / 2**20
        lines.append(f"| {name} | {step:.4f} | {peak:.0f} | {' '.join(f'{x:.6f}' for x in runs[0][name]['losses'])} |")
    diff = max(abs(a - b) for r in runs for a, b in zip(r[base]["losses"], r[ours]["losses"], strict=True))
    time_ratio = [r[ours]["step"] / r[base]["step"] for r in runs]
    mem_ratio = [r[ours]["peak_bytes"] / r[base]["peak_bytes"] for r in runs]
    return lines + ["", f"step time ratio {spread(time_ratio)}, peak memory ratio {spread(mem_ratio)}, "
                        f"max |loss diff| {diff:.2e}"]


def run_worker_self(script: str, auto: str, *extra: str, **env: str) -> dict:
    """Run `script --worker ARGS` (this process's arguments plus `extra`) with MINDSPEED_HF_AUTO=`auto` and `env`;
    the JSON object on the last line of its output."""
    import json
    import os
    import subprocess
    import sys

    cmd = [sys.executable, script, "--worker", *extra, *sys.argv[1:]]
    out = subprocess.run(cmd, env={**os.environ, "MINDSPEED_HF_AUTO": auto, **env}, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])
