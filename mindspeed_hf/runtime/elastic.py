"""Whether this process is a restarted attempt of a job, as its launcher says.

torchrun (torch.distributed.elastic, also under `accelerate launch`) restarts every worker of a group when one fails,
up to `--max-restarts` times, and tells the workers which attempt they are: TORCHELASTIC_RESTART_COUNT (0 the first
time). A SLURM job requeued after a node failure or a preemption gets SLURM_RESTART_COUNT. On a restart a Trainer run
resumes from the newest complete checkpoint of its output_dir by itself (trainers/starting.py); an accelerate loop is
told what it must do (its script owns resuming: `Accelerator.load_state`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["RESTART_VARIABLES", "Restart", "restart"]

#: the launchers' restart counters, in the order they are read
RESTART_VARIABLES = {"TORCHELASTIC_RESTART_COUNT": "torchrun restart", "SLURM_RESTART_COUNT": "SLURM requeue"}


@dataclass(frozen=True)
class Restart:
    """A restarted attempt: the variable that says so and its count."""

    variable: str
    count: int

    def __str__(self) -> str:
        return f"{RESTART_VARIABLES[self.variable]} {self.count} ({self.variable}={self.count})"


def restart(env: Mapping[str, str] | None = None) -> Restart | None:
    """The restart this process is (None on a first attempt, or when no launcher counts restarts)."""
    env = os.environ if env is None else env
    for name in RESTART_VARIABLES:
        text = env.get(name, "").strip()
        if text.isdigit() and int(text) > 0:
            return Restart(name, int(text))
    return None
