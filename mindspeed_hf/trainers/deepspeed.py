"""DeepSpeed ZeRO inside transformers.Trainer: DeepSpeed shards, mindspeed_hf's kernels and fused loss run inside.

A script with `--deepspeed ds_config.json` (ZeRO-1/2/3, optimizer offload) keeps working after `import mindspeed_hf`:
DeepSpeed owns the data-parallel sharding, the optimizer and the checkpoints, and the model it wraps runs our
kernels; the fused loss calls a ZeRO-3 (partitioned) lm_head module per chunk, so DeepSpeed's own hooks gather it and
reduce-scatter its gradient (ops/fused_linear_cross_entropy.py). Two things are done here, when the TrainingArguments
are created (the wiring wraps `TrainingArguments.__post_init__`, a dataclass hook, and MindSpeedTrainingArguments
calls the same functions):

- `before_arguments`: our FSDP2 / context / expert / tensor parallelism together with DeepSpeed is refused with one line
  that says what to drop (`check_exclusive`). On a machine without an accelerator, under a multi-process launcher,
  DeepSpeed runs on CPU and accelerate counts the processes only with `use_cpu`; without it each rank would believe
  it is alone and HF would fill `train_batch_size` for one process. It is set (and logged) for such a run.
- `after_arguments`: DeepSpeed's communication layer is initialised over the process group accelerate created, so
  a ZeRO-3 model built next under `deepspeed.zero.Init` (HF's `from_pretrained` / `from_config`) sees the real
  world size (on CPU accelerate does not initialise it, and zero.Init then reads a world size of 1 and fails its
  batch-size check).

`check_exclusive` runs again when the trainer starts (lifecycle.start) for settings given later (enable(config)).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from ..config import AXES, Axis, ResolvedConfig
from ..device import detect_device_type
from ..runtime import resolve_config
from ..value_kinds import parse_flag

logger = logging.getLogger("mindspeed_hf")

ARGUMENT_SOURCE = "TrainingArguments.deepspeed (--deepspeed)"
ENV_SOURCE = "accelerate launch environment (ACCELERATE_USE_DEEPSPEED)"


def requested(args: Any, env: Mapping[str, str] | None = None) -> str | None:
    """Where DeepSpeed is asked for (the TrainingArguments' `deepspeed` config, or `accelerate launch` with a
    DeepSpeed config), or None."""
    env = os.environ if env is None else env
    if getattr(args, "deepspeed", None):
        return ARGUMENT_SOURCE
    if parse_flag(env.get("ACCELERATE_USE_DEEPSPEED", "false"), "ACCELERATE_USE_DEEPSPEED"):
        return ENV_SOURCE
    return None


def _fsdp(args: Any, env: Mapping[str, str]) -> str | None:
    """FSDP asked for by the TrainingArguments (read as given: this runs before and after their __post_init__) or
    by `accelerate launch`."""
    if getattr(args, "fsdp", None):
        return "FSDP (TrainingArguments.fsdp)"
    if parse_flag(env.get("ACCELERATE_USE_FSDP", "false"), "ACCELERATE_USE_FSDP"):
        return "FSDP (accelerate launch environment, ACCELERATE_USE_FSDP)"
    return None


def _active(resolved: ResolvedConfig, axis: Axis) -> bool:
    """The axis builds something: a size above 1, or dp_shard=-1 stated (shard over the whole world)."""
    value = resolved.value(axis.path)
    return value > 1 or (value == -1 and resolved.is_set(axis.path))


def _ours(args: Any, resolved: ResolvedConfig, env: Mapping[str, str]) -> list[str]:
    """mindspeed_hf's own parallelism that this trainer would build, each as 'what (asked by where)': the axes of
    AXES that DeepSpeed excludes, grouped by what they build (dp_replicate and dp_shard: FSDP2)."""
    found = [fsdp] if (fsdp := _fsdp(args, env)) else []
    groups: dict[str, list[Axis]] = {}
    for axis in AXES:
        if axis.deepspeed_excludes:
            groups.setdefault(axis.what, []).append(axis)
    for what, axes in groups.items():
        if any(_active(resolved, axis) for axis in axes):
            paths = [a.path for a in axes if resolved.is_set(a.path)] or [a.path for a in axes if _active(resolved, a)]
            found.append(f"{what} ({', '.join(resolved.describe(path) for path in paths)})")
    return found


def check_exclusive(args: Any, resolved: ResolvedConfig | None = None, env: Mapping[str, str] | None = None) -> None:
    """Refuse DeepSpeed together with mindspeed_hf's FSDP2 / context / expert / tensor parallelism, before any work:
    both
    would shard the same model. ValueError naming both sides and what to drop. `resolved` defaults to the config a
    trainer given `args` would use."""
    env = os.environ if env is None else env
    source = requested(args, env)
    if source is None:
        return
    fsdp = _fsdp(args, env)  # found first: the config below reads fsdp_config, which may not be parsed yet
    if resolved is None and fsdp is None:
        resolved = resolve_config(args)
    ours = [fsdp] if resolved is None else _ours(args, resolved, env)
    if ours:
        raise ValueError(f"DeepSpeed ({source}) cannot be combined with {'; '.join(ours)}: both shard the model; "
                         "drop one: remove the deepspeed config, or remove those settings (mindspeed_hf's kernels "
                         "and fused loss run under DeepSpeed either way)")


def before_arguments(args: Any, env: Mapping[str, str] | None = None) -> None:
    """Before TrainingArguments set anything up: refuse our parallelism with DeepSpeed (check_exclusive); on CPU
    under a multi-process launcher set `use_cpu`, so accelerate counts every process (and HF fills the batch sizes
    of the DeepSpeed config for all of them)."""
    env = os.environ if env is None else env
    if requested(args, env) is None:
        return
    check_exclusive(args, env=env)
    if getattr(args, "use_cpu", True):
        return
    if int(env.get("WORLD_SIZE", "1") or "1") > 1 and detect_device_type() == "cpu":
        args.use_cpu = True
        logger.info("mindspeed_hf: DeepSpeed on CPU with %s processes: use_cpu=True so accelerate counts them all",
                    env["WORLD_SIZE"])


def init_comm() -> bool:
    """Initialise DeepSpeed's communication layer over the existing torch process group, if that group exists and
    deepspeed.comm does not yet. Returns True when it initialised it."""
    if not (dist.is_available() and dist.is_initialized()) or importlib.util.find_spec("deepspeed") is None:
        return False
    import deepspeed
    import deepspeed.comm

    if deepspeed.comm.is_initialized():
        return False
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    logger.info("mindspeed_hf: deepspeed.comm initialised over the %s process group (world size %d): a ZeRO-3 model "
                "built under zero.Init is partitioned over every rank", dist.get_backend(), dist.get_world_size())
    return True


def after_arguments(args: Any) -> None:
    """Once TrainingArguments are set up (and with them the process group): initialise deepspeed.comm over it."""
    if requested(args) is not None:
        args.world_size  # noqa: B018 - sets up the devices (and the process group) if HF has not yet
        init_comm()
