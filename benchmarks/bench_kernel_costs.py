"""What each kernel costs or saves on the torch backend, in one process: a tiny model's forward (with labels, grad on)
timed under configs that differ in one kernel, the configs alternating round by round on the same model (the
process, the caches and the machine's state shared), against the config with every kernel off (the hooks and
switches alone). At a Python-bound size (1 x 4 tokens) the difference is the host work of the kernel's path; at the
families benchmark's size (4 x 64) the tensor work shows too. Then whole steps (forward, backward, AdamW) of plain
Hugging Face against everything on, also alternating in one process (mindspeed_hf disabled and enabled between
rounds), forward and backward apart.

    taskset -c 1 python benchmarks/bench_kernel_costs.py --family llama --out benchmarks/results/kernel_costs_cpu.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from ab_steps import ratios, step_phases
from results_io import emit

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ("rms_norm", "rope", "swiglu", "attention", "fused_linear_cross_entropy")


def _config(on: tuple[str, ...]):
    """Ours for the kernels `on` (kernels.torch_path: fused, so none is handed to HF's code)."""
    from mindspeed_hf.config import KernelConfig, MindSpeedConfig

    return MindSpeedConfig(kernels=KernelConfig(torch_path="fused", **{k: k in on for k in KERNELS}))


def _median_forward(model, ids, forwards: int) -> float:
    times = []
    for _ in range(forwards):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss  # noqa: B018  (the forward with labels is what is timed)
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:])


def kernel_rows(family: str, shape: tuple[int, int], rounds: int, forwards: int) -> list[str]:
    """One row per kernel: forward with only that kernel on, against every kernel off, alternating."""
    import torch
    from tiny_models import VOCAB, tiny_model

    import mindspeed_hf

    model = tiny_model(family).train()
    ids = torch.randint(2, VOCAB, shape, generator=torch.Generator().manual_seed(1))
    variants = {"all off": (), **{k: (k,) for k in KERNELS}, "all on": KERNELS}
    configs = {name: _config(on) for name, on in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, config in configs.items():
            mindspeed_hf.apply_to_model(model, config)
            times[name].append(_median_forward(model, ids, forwards))
    base = statistics.median(times["all off"])
    rows = []
    for name in variants:
        value = statistics.median(times[name])
        deltas = sorted(t - b for t, b in zip(times[name], times["all off"], strict=True))
        rows.append(f"| {shape[0]} x {shape[1]} | {name} | {value * 1e6:.0f} | {(value - base) * 1e6:+.0f} "
                    f"[{deltas[0] * 1e6:+.0f} .. {deltas[-1] * 1e6:+.0f}] |")
    return rows


def step_rows(family: str, shape: tuple[int, int], rounds: int, steps: int) -> list[str]:
    """Plain HF against everything on, whole steps, forward and backward apart (medians of per-round medians)."""
    phases, _, _ = step_phases(family, shape, rounds, steps)
    rows = []
    for name, values in phases.items():
        fwd, bwd, whole = (statistics.median(v[i] for v in values) for i in range(3))
        rows.append(f"| {name} | {fwd * 1e3:.3f} | {bwd * 1e3:.3f} | {whole * 1e3:.3f} |")
    per_round = ratios(phases)
    rows.append(f"| ratio (per round) | | | {statistics.median(per_round):.3f}x "
                f"[{per_round[0]:.3f}-{per_round[-1]:.3f}] |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="llama", help="a model type of tests/tiny_models.py")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--forwards", type=int, default=60, help="timed forwards per config and round")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per run and round (plain against ours)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("MINDSPEED_HF_AUTO", "0")  # enabled by hand below
    os.environ.setdefault("MINDSPEED_HF_BACKEND", "torch")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import torch

    torch.set_num_threads(1)
    steps = step_rows(args.family, (4, 64), args.rounds, args.steps)
    import mindspeed_hf

    mindspeed_hf.enable()
    lines = [f"`taskset -c N python benchmarks/bench_kernel_costs.py {' '.join(sys.argv[1:])}`", "",
             f"Tiny {args.family} of tests/tiny_models.py (hidden 64, 2 layers, vocabulary 128), fp32, backend torch, "
             f"one thread, affinity {sorted(os.sched_getaffinity(0))}, {args.rounds} alternating rounds in one "
             "process.",
             "", "Forward with labels (grad on), one kernel on at a time against all off (the hooks and switches "
             f"alone); median of {args.forwards} forwards per round, median over rounds; the delta's range is per "
             "round:", "", "| tokens | kernels on | forward (us) | vs all off (us), median [min .. max] |",
             "|---|---|---|---|"]
    for shape in ((1, 4), (4, 64)):
        lines += kernel_rows(args.family, shape, args.rounds, args.forwards)
    lines += ["", f"Whole steps at 4 x 64 tokens (forward with labels, backward, AdamW), plain HF against everything "
              f"on, median of {args.steps} steps per round:", "",
              "| run | forward (ms) | backward (ms) | step (ms) |", "|---|---|---|---|", *steps]
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
