"""Whether this process is a restarted attempt of a job, as its launcher says.

torchrun (torch.distributed.elastic, also under `accelerate launch`) restarts every worker of a group when one fails,
up to `--max-restarts` times, and tells the workers which attempt they are: TORCHELASTIC_RESTART_COUNT (0 the first
time). A SLURM job requeued after a node failure or a preemption gets SLURM_RESTART_COUNT. On a restart a Trainer run
resumes from the newest complete checkpoint of its output_dir by itself (trainers/starting.py); an accelerate loop is
told what it must do (its script owns resuming: `Accelerator.load_state`).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["RESTART_VARIABLES", "Restart", "check_launcher", "restart"]

logger = logging.getLogger("mindspeed_hf")

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


@functools.cache
def check_launcher() -> None:
    """Once per process, rank 0: torchrun with restarts and its rendezvous store shared with the workers (torch's
    default) keeps the previous attempt's process-group addresses, so a restarted attempt's process groups may fail
    to connect (pytorch/pytorch#135712; seen with torch 2.13 and gloo as soon as a job has more than the default
    group, as every FSDP2 mesh does): say how to launch instead."""
    env = os.environ
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0").strip()
    if (restarts.isdigit() and int(restarts) > 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and env.get("RANK", "0") == "0"):
        logger.warning("mindspeed_hf: torchrun --max-restarts %s shares its rendezvous store with the workers: a "
                       "restarted attempt may fail to connect its process groups (the previous attempt's addresses "
                       "are still in it); launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for restarts that work",
                       restarts)
