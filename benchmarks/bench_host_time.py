"""Host (CPU) time of the README's example, accelerated against plain: examples/sft_trainer.py run as separate
processes, MINDSPEED_HF_AUTO=1 and =0 in interleaved pairs, one thread each (OMP_NUM_THREADS=1; pin the whole
benchmark with `taskset -c N`). Per run: CPU seconds of the whole process (import included, from the OS), the
median training step (wall and CPU, first 5 steps left out) and the import time of mindspeed_hf.

    taskset -c 1 python benchmarks/bench_host_time.py --pairs 3 --steps 40 --out benchmarks/results/host_time_cpu.md

--control: a third run in every pair, plain HF again (the order rotated): how far two identical runs differ, and how
often the issue's test (the median of 3 consecutive pairs <= 1.00) passes for mindspeed_hf and for plain HF itself.

    taskset -c 1 python benchmarks/bench_host_time.py --control --pairs 21 \
        --out benchmarks/results/host_time_control_cpu.md

--busy N: the busy-machine comparison instead. Torch's default threads, not pinned; each pair runs both variants
on the quiet machine, then again while N other processes spin on the CPU (a shared machine's other jobs): how much
each variant slows down under the load, side by side.

    python benchmarks/bench_host_time.py --busy 2 --threads '' --pairs 3 --out benchmarks/results/host_time_busy_cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_io import emit

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "host_time_child.py"
CONTROL = "plain again"  # --control: a second plain run in every pair


def one_run(auto: str, steps: int, threads: str | None) -> dict:
    """One process of the example; its whole-process CPU seconds (user + system) and the child's step figures."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "MINDSPEED_HF_AUTO": auto, "HOST_TIME_OUT": f"{tmp}/t.json"}
        if threads is not None:
            env["OMP_NUM_THREADS"] = threads
        cmd = [sys.executable, str(CHILD), str(ROOT / "examples" / "sft_trainer.py"), "--max_steps", str(steps),
               "--output_dir", tmp, "--losses_file", f"{tmp}/losses.jsonl"]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if status != 0:
            raise RuntimeError(f"{cmd} failed ({status})")
        timed = json.loads(Path(f"{tmp}/t.json").read_text())
        losses = [json.loads(line)["loss"] for line in Path(f"{tmp}/losses.jsonl").read_text().splitlines()
                  if '"loss"' in line]
    later = timed["steps"][5:] or timed["steps"]
    return {"cpu_s": usage.ru_utime + usage.ru_stime, "wall_s": wall, "import_s": timed["import_s"],
            "step_s": statistics.median(w for w, _ in later), "step_cpu_s": statistics.median(c for _, c in later),
            "losses": losses}


def micro_worker(calls: int) -> None:
    """Print (JSON) the seconds per call of the tiny model's final RMSNorm on a small tensor: patched under
    MINDSPEED_HF_AUTO=1 (its scope hooks and kernel included), HF's own module under =0."""
    import time

    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    from common import load_tokenizer, tiny_model

    import mindspeed_hf  # noqa: F401

    norm = tiny_model(load_tokenizer()).model.norm
    x = torch.randn(1, 8, norm.weight.shape[0])
    with torch.no_grad():
        for _ in range(200):
            norm(x)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                norm(x)
            best = min(best, (time.perf_counter() - start) / calls)
    print(json.dumps({"call_s": best}))


def micro(pairs: int, calls: int) -> list[str]:
    """Per-call time of RMSNorm, accelerated vs plain, in interleaved process pairs (best of 5 loops each)."""
    runs = []
    for i in range(pairs):
        pair = {}
        for auto in ("0", "1") if i % 2 == 0 else ("1", "0"):
            out = subprocess.run([sys.executable, __file__, "--micro-worker", "--calls", str(calls)], check=True,
                                 capture_output=True, text=True, env={**os.environ, "MINDSPEED_HF_AUTO": auto,
                                                                      "OMP_NUM_THREADS": "1"}).stdout
            pair[auto] = json.loads(out.strip().splitlines()[-1])
        runs.append(pair)
    return ["", f"Per call, RMSNorm(128) on a (1, 8, 128) fp32 tensor, no grad, {calls} calls, best of 5 loops, "
                f"{pairs} process pairs:", "", "| measure | plain HF | mindspeed_hf | ratio, median [min-max] |",
            "|---|---|---|---|", ratio_line("RMSNorm call (s)", runs, "call_s", digits=7)]


def busy(pairs: int, steps: int, threads: str | None, spinners: int) -> list[str]:
    """Both variants on the quiet machine, then while `spinners` processes spin on the CPU, in interleaved pairs:
    each variant's slow-down under the load (busy / quiet), and ours against plain's."""
    runs = []
    for i in range(pairs):
        order = ("0", "1") if i % 2 == 0 else ("1", "0")
        quiet = {auto: one_run(auto, steps, threads) for auto in order}
        load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners)]
        try:
            loaded = {auto: one_run(auto, steps, threads) for auto in order}
        finally:
            for proc in load:
                proc.kill()
                proc.wait()
        runs.append({auto: {**{f"quiet_{k}": v for k, v in quiet[auto].items()},
                            **{f"busy_{k}": v for k, v in loaded[auto].items()},
                            "slowdown_step": loaded[auto]["step_s"] / quiet[auto]["step_s"],
                            "slowdown_wall": loaded[auto]["wall_s"] / quiet[auto]["wall_s"]} for auto in order})
    return ["| measure | plain HF (MINDSPEED_HF_AUTO=0) | mindspeed_hf | ratio, median [min-max] |",
            "|---|---|---|---|",
            ratio_line("training step wall, quiet (s)", runs, "quiet_step_s"),
            ratio_line("training step wall, busy (s)", runs, "busy_step_s"),
            ratio_line("step slow-down under the load (busy / quiet)", runs, "slowdown_step", digits=2),
            ratio_line("whole process wall, quiet (s)", runs, "quiet_wall_s", digits=2),
            ratio_line("whole process wall, busy (s)", runs, "busy_wall_s", digits=2),
            ratio_line("whole-process slow-down under the load (busy / quiet)", runs, "slowdown_wall", digits=2)]


def ratio_line(name: str, pairs: list[dict], key: str, digits: int = 4, run: str = "1") -> str:
    """A table row: `run` ("1" mindspeed_hf, CONTROL plain HF again) against plain HF over the pairs."""
    ratios = [p[run][key] / p["0"][key] for p in pairs]
    plain = statistics.median(p["0"][key] for p in pairs)
    other = statistics.median(p[run][key] for p in pairs)
    return (f"| {name} | {plain:.{digits}f} | {other:.{digits}f} | {statistics.median(ratios):.3f}x "
            f"[{min(ratios):.3f}-{max(ratios):.3f}] |")


def three_pair_passes(pairs: list[dict], run: str, window: int = 3) -> str:
    """How often the issue's test (the median ratio of `window` consecutive pairs, whole-process CPU) comes out
    <= 1.00 over every window of the run: the chance that one such measurement passes."""
    ratios = [p[run]["cpu_s"] / p["0"]["cpu_s"] for p in pairs]
    medians = [statistics.median(ratios[i:i + window]) for i in range(len(ratios) - window + 1)]
    return f"{sum(m <= 1.0 for m in medians)} of {len(medians)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", default="1", help="OMP_NUM_THREADS of the runs ('' leaves the default)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--busy", type=int, default=0, help="the busy-machine comparison, with N spinning processes")
    ap.add_argument("--calls", type=int, default=5000, help="calls per timed loop of the RMSNorm micro-benchmark")
    ap.add_argument("--control", action="store_true",
                    help="a third run per pair, plain HF again: the resolution of the comparison")
    ap.add_argument("--micro-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.micro_worker:
        micro_worker(args.calls)
        return
    threads = args.threads or None
    if args.busy:
        lines = [f"`python benchmarks/bench_host_time.py {' '.join(sys.argv[1:])}`", "",
                 f"examples/sft_trainer.py, {args.steps} steps, {args.pairs} interleaved process pairs, "
                 f"OMP_NUM_THREADS={threads or 'default'}, affinity {sorted(os.sched_getaffinity(0))}; busy: "
                 f"{args.busy} processes spinning on the CPU", "", *busy(args.pairs, args.steps, threads, args.busy)]
        emit("\n".join(lines) + "\n", args.out)
        return
    runs = ("0", "1", CONTROL) if args.control else ("0", "1")
    pairs = []
    for i in range(args.pairs):
        order = runs[i % len(runs):] + runs[:i % len(runs)]  # each run first, second (and last) in turn
        pairs.append({run: one_run("0" if run == CONTROL else run, args.steps, threads) for run in order})
    diff = max(abs(a - b) for p in pairs for a, b in zip(p["0"]["losses"], p["1"]["losses"], strict=True))
    lines = [f"`taskset -c N python benchmarks/bench_host_time.py {' '.join(sys.argv[1:])}`", "",
             f"examples/sft_trainer.py, {args.steps} steps, {args.pairs} interleaved process "
             f"{'triples (plain HF, mindspeed_hf, plain HF again; the order rotated)' if args.control else 'pairs'}, "
             f"OMP_NUM_THREADS={threads or 'default'}, affinity {sorted(os.sched_getaffinity(0))}",
             "", "| measure | plain HF (MINDSPEED_HF_AUTO=0) | mindspeed_hf | ratio, median [min-max] |",
             "|---|---|---|---|",
             ratio_line("whole process CPU seconds (import included)", pairs, "cpu_s"),
             ratio_line("training step wall (s, median of steps 6..)", pairs, "step_s"),
             ratio_line("training step CPU (s, median of steps 6..)", pairs, "step_cpu_s"),
             ratio_line("`import mindspeed_hf` after torch / transformers / accelerate (CPU s)", pairs, "import_s"),
             "", f"max |loss diff| between the runs {diff:.2e}"]
    if args.control:
        lines += ["", "Plain HF against itself (the same script, MINDSPEED_HF_AUTO=0 twice): what two identical runs "
                  "differ by, the comparison's resolution.", "",
                  "| measure | plain HF | plain HF again | ratio, median [min-max] |", "|---|---|---|---|",
                  ratio_line("whole process CPU seconds (import included)", pairs, "cpu_s", run=CONTROL),
                  ratio_line("training step wall (s, median of steps 6..)", pairs, "step_s", run=CONTROL),
                  "", "Windows of 3 consecutive runs whose median whole-process ratio is <= 1.00 (the issue's test): "
                  f"mindspeed_hf {three_pair_passes(pairs, '1')}, plain HF again {three_pair_passes(pairs, CONTROL)}."]
    lines += micro(args.pairs, args.calls)
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
