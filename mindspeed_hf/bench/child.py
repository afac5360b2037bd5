"""The child processes of `mindspeed-hf bench`, one side each (MINDSPEED_HF_AUTO set by the parent):

    python -m mindspeed_hf.bench.child timed [CONFIG] --out F [overrides]    the `train` run, timed per step
    python -m mindspeed_hf.bench.child counted [CONFIG] --out F [--profile DIR] [overrides]   bench_counts

A timed run writes `train`'s metrics plus every step's time and tokens: the median step is what a burst of load
from other work on the machine moves least (the whole-run tokens/s takes every burst in).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback


class StepTimes(TrainerCallback):
    """Wall time, host time (CPU seconds of the process, every thread) and input tokens of every Trainer step
    (on_step_begin .. on_step_end). On an accelerator the host time is the Python and launch cost between kernels;
    on a CPU it is the step's whole cost."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, int]] = []  # (wall s, host s, input tokens) per step
        self._start: tuple[float, float, int] = (0.0, 0.0, 0)

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = (time.perf_counter(), time.process_time(), state.num_input_tokens_seen)

    def on_step_end(self, args, state, control, **kwargs):
        wall, host, tokens = self._start
        self.steps.append((time.perf_counter() - wall, time.process_time() - host,
                           state.num_input_tokens_seen - tokens))

    def summary(self) -> dict[str, Any]:
        """Median step time and host time (ms) and median per-step tokens/s, the first step (one-time costs) left
        out."""
        steady = self.steps[1:] or self.steps
        if not steady:
            return {}
        return {"step_times_s": [t for t, _, _ in self.steps],
                "step_time_ms": 1000 * statistics.median(t for t, _, _ in steady),
                "step_host_ms": 1000 * statistics.median(h for _, h, _ in steady),
                "step_tokens_per_s": statistics.median(n / t for t, _, n in steady if t > 0) if any(
                    n for _, _, n in steady) else None}


def timed_run(config: str | None, overrides: list[str], out: str) -> dict[str, Any]:
    """The `train` run (no quality check) with every step timed; writes its metrics to `out` and returns them."""
    from ..recipes.run_config import load_run_config
    from ..recipes.text import run_training, training_args_for

    run = load_run_config(config)
    timer = StepTimes()
    result = run_training(run, training_args_for(run, overrides), quality_eval=False, callbacks=[timer])
    result.update(timer.summary())
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1, default=str))
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of one child run of `mindspeed-hf bench`."""
    from ..recipes.run_config import split_config
    from .counts import counted_run

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m mindspeed_hf.bench.child", allow_abbrev=False)
    parser.add_argument("--out", required=True, help="write the run's figures here as JSON")
    parser.add_argument("--profile", default=None, help="counted: then profile a few steps into this directory")
    if not argv or argv[0] not in ("timed", "counted"):
        parser.error("the first argument is the kind of run: timed or counted")
    config, rest = split_config(argv[1:])
    own, overrides = parser.parse_known_args(rest)
    if argv[0] == "timed":
        timed_run(config, overrides, own.out)
    else:
        counted_run(config, overrides, own.out, profile=own.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
