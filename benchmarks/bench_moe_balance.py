"""Auxiliary-loss-free balancing (moe: {balance: aux_free}) on a skewed router: the expert imbalance (busiest
expert's tokens over the mean, averaged over the MoE layers) per step of a tiny qwen3_moe whose routers send every
token to expert 0 (tests/tiny_models.skewed_moe_model), with balancing off and at several update rates.

    python benchmarks/bench_moe_balance.py [--steps 50] [--out benchmarks/results/moe_balance_cpu.md]

Each step is a training-mode forward on the same batch, then the balance step (the update an optimizer step
triggers in a Trainer run); the weights do not change, so what moves the load is the bias alone. Deterministic on
CPU: one run per setting.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models

from results_io import emit  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rates", default="0.002,0.01,0.02")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    settings = [None, *(float(r) for r in args.rates.split(","))]
    from tiny_models import imbalance_per_step

    runs = {rate: imbalance_per_step({} if rate is None else {"moe": {"balance": "aux_free", "bias_update_rate": rate}},
                                     args.steps) for rate in settings}
    marks = sorted({0, 9, 19, 29, 39, args.steps - 1} & set(range(args.steps)))
    lines = [f"# Aux-free balancing on a skewed router (tiny qwen3_moe, 4 experts top-2, 2 MoE layers, every token "
             f"routed to expert 0 at first): imbalance (busiest expert / mean, mean over layers; 2.0 = one expert "
             f"takes every token's first slot) per step, {args.steps} steps on CPU", "",
             "| setting | " + " | ".join(f"step {m + 1}" for m in marks) + " | mean of the last 10 |",
             "|---|" + "---|" * (len(marks) + 1)]
    for rate, values in runs.items():
        name = "balance: none" if rate is None else f"aux_free, rate {rate:g}"
        last = sum(values[-10:]) / len(values[-10:])
        lines.append(f"| {name} | " + " | ".join(f"{values[m]:.2f}" for m in marks) + f" | {last:.2f} |")
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
