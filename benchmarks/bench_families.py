"""Step time of every supported family's tiny model on the torch backend (the CPU reference path), accelerated
against plain Hugging Face: the tiny configs of the parity tests (tests/tiny_models.py: hidden 64, 2 layers (4 for
the hybrid linear-attention families), vocabulary 128), a plain loop of forward with labels, backward and AdamW
step on a fixed batch. One process per (variant, pair) trains every family in turn; the variants alternate in
interleaved pairs, one thread each (pin the whole benchmark with `taskset -c N`). Per family and run: the median
step (wall, after the first 5), and the losses (plain and accelerated must agree to 1e-5).

    taskset -c 1 python benchmarks/bench_families.py --pairs 3 --steps 25 --out benchmarks/results/families_cpu.md

`--in-process`: the runs of each family in this one process instead, alternating round by round (mindspeed_hf
disabled and enabled between rounds, benchmarks/ab_steps.py): without the +-10% spread between processes; a
second plain run beside them shows what two identical runs differ by.

    taskset -c 1 python benchmarks/bench_families.py --in-process --rounds 12 --steps 30 \
        --out benchmarks/results/families_inprocess_cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from results_io import emit, spread

ROOT = Path(__file__).resolve().parent.parent


def worker(families: list[str], steps: int, batch: int, seq: int) -> None:
    """Train each family's tiny model `steps` steps; print {family: {"step_s", "losses"}} as JSON."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from tiny_models import VOCAB, tiny_model

    import mindspeed_hf  # enabled or not by MINDSPEED_HF_AUTO (the parent sets it)

    torch.set_num_threads(1)
    out = {}
    for family in families:
        model = tiny_model(family).train()
        if mindspeed_hf.is_enabled():
            mindspeed_hf.apply_to_model(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(2, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))
        times, losses = [], []
        for _ in range(steps):
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        out[family] = {"step_s": statistics.median(times[5:] or times), "losses": losses,
                       "ran": mindspeed_hf.report(model)["ran"] if mindspeed_hf.is_enabled() else {}}
    print(json.dumps(out))


def run(auto: str, families: list[str], args: argparse.Namespace) -> dict:
    env = {**os.environ, "MINDSPEED_HF_AUTO": auto, "OMP_NUM_THREADS": "1", "MINDSPEED_HF_BACKEND": "torch",
           "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, __file__, "--worker", "--steps", str(args.steps), "--batch", str(args.batch), "--seq",
           str(args.seq), "--families", ",".join(families)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"MINDSPEED_HF_AUTO={auto} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--families", default="", help="comma-separated model types (default: every tiny config)")
    ap.add_argument("--in-process", action="store_true", help="plain and accelerated alternating in this process")
    ap.add_argument("--rounds", type=int, default=8, help="alternating rounds per family (--in-process)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    families = [f for f in args.families.split(",") if f]
    if args.worker:
        worker(families, args.steps, args.batch, args.seq)
        return
    if not families:
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_models import FAMILY_CONFIGS, HYBRID_CONFIGS, modeling_of

        families = [f for f in (*FAMILY_CONFIGS, *HYBRID_CONFIGS) if modeling_of(f) is not None]
    if args.in_process:
        emit(in_process(families, args), args.out)
        return
    pairs = []
    for i in range(args.pairs):
        order = ("0", "1") if i % 2 == 0 else ("1", "0")
        pairs.append({auto: run(auto, families, args) for auto in order})
    lines = [f"`taskset -c N python benchmarks/bench_families.py {' '.join(sys.argv[1:])}`", "",
             f"Tiny models of tests/tiny_models.py, batch {args.batch} x {args.seq} tokens, fp32, {args.steps} steps "
             f"(median of steps 6..), backend torch, {args.pairs} interleaved process pairs, one thread, affinity "
             f"{sorted(os.sched_getaffinity(0))}", "",
             "| family | plain HF step (ms) | mindspeed_hf step (ms) | ratio, median [min-max] | max loss diff | "
             "kernels that ran (first accelerated run) |", "|---|---|---|---|---|---|"]
    for family in families:
        ratios = [p["1"][family]["step_s"] / p["0"][family]["step_s"] for p in pairs]
        plain = statistics.median(p["0"][family]["step_s"] for p in pairs) * 1e3
        ours = statistics.median(p["1"][family]["step_s"] for p in pairs) * 1e3
        diff = max(abs(a - b) for p in pairs for a, b in zip(p["0"][family]["losses"], p["1"][family]["losses"],
                                                               strict=True))
        ran = ", ".join(op for op, n in pairs[0]["1"][family]["ran"].items() if n)
        lines.append(f"| {family} | {plain:.2f} | {ours:.2f} | {statistics.median(ratios):.3f}x "
                     f"[{min(ratios):.3f}-{max(ratios):.3f}] | {diff:.1e} | {ran} |")
    emit("\n".join(lines) + "\n", args.out)


def in_process(families: list[str], args: argparse.Namespace) -> str:
    """The table of `--in-process`: every family's plain and accelerated runs alternating in this process."""
    os.environ.update(MINDSPEED_HF_AUTO="0", MINDSPEED_HF_BACKEND="torch", TRANSFORMERS_VERBOSITY="error")
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import torch
    from ab_steps import CONTROL, ratios, step_phases

    torch.set_num_threads(1)
    lines = [f"`taskset -c N python benchmarks/bench_families.py {' '.join(sys.argv[1:])}`", "",
             f"Tiny models of tests/tiny_models.py, batch {args.batch} x {args.seq} tokens, fp32, backend torch, one "
             f"process: plain HF, mindspeed_hf and plain HF again (three copies of each model from one seed, fresh "
             f"every round) alternating over {args.rounds} rounds of {args.steps} steps (median of steps 4..; the "
             f"order reversed every other round), one thread, affinity {sorted(os.sched_getaffinity(0))}. The last "
             f"ratio column, plain HF against itself, is what two identical runs differ by: the table's resolution.",
             "",
             "| family | plain HF step (ms) | mindspeed_hf step (ms) | ratio per round, median [min-max] | "
             "max loss diff | kernels that ran | plain HF again / plain HF |", "|---|---|---|---|---|---|---|"]
    for family in families:
        phases, losses, ran = step_phases(family, (args.batch, args.seq), args.rounds, args.steps, control=True)
        plain, ours = (statistics.median(v[2] for v in phases[name]) * 1e3 for name in ("plain HF", "mindspeed_hf"))
        per_round, again = ratios(phases), ratios(phases, CONTROL)
        diff = max(abs(a - b) for a, b in zip(losses["plain HF"], losses["mindspeed_hf"], strict=True))
        lines.append(f"| {family} | {plain:.2f} | {ours:.2f} | {spread(per_round, 3)} | {diff:.1e} | "
                     f"{', '.join(op for op, n in ran.items() if n)} | {spread(again, 3)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
