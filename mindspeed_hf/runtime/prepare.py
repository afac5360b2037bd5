"""A model prepared for training, once, whoever trains it: the one path a model takes into mindspeed_hf.

`prepare_model(run, model)` attaches the run's config and kernels to the model (patches/apply.py), builds the run's
mesh when its plan asks for one, and runs `parallel.parallelize` (tp, ep, cp, recompute, offload, FSDP2); then the
MoE aids the config asks for. A Trainer calls it when a model reaches it (trainers/lifecycle.py), an accelerate loop
when `Accelerator.prepare` meets the model (runtime/accelerator.py); a Trainer's own `accelerator.prepare` finds the
model prepared already and leaves it as it is.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import parallel
from ..device import detect_device_type, local_rank
from ..memory.recompute import absorb_hf_checkpointing, hf_checkpointing_on
from ..moe import AuxFreeBalance, ExpertLoad
from ..parallel.parallelize import ParallelizeOptions, parallelize
from ..parallel.towers import keep_media_in_step, tower_modules
from ..patches import apply
from .loop_cp import install_loop_split
from .run import Run

__all__ = ["ensure_dims", "low_precision", "prepare_model"]

logger = logging.getLogger("mindspeed_hf")


def low_precision(mixed_precision: Any) -> torch.dtype | None:
    """The dtype of a bf16 / fp16 mixed-precision setting (accelerate's names; also its environment's), or None."""
    mixed = mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(getattr(mixed, "value", mixed)).lower())


def ensure_dims(run: Run) -> parallel.ParallelDims | None:
    """The run's built mesh (collective the first time: the process group started if it is not, the named mesh
    built from the plan); None when the run has no plan."""
    if run.plan is None or run.dims is not None:
        return run.dims
    run.device_type = detect_device_type()
    parallel.init_distributed(run.device_type)
    world = dist.get_world_size()
    planned = run.plan.dims  # validated against the world size when the plan was read
    run.dims = planned if planned is not None and planned.world_size == world else run.plan.new_dims(world)
    run.dims.build_mesh(run.device_type)
    return run.dims


def prepare_model(run: Run, model: nn.Module) -> nn.Module:
    """Attach the run's config to `model` (PEFT-wrapped too), run `parallelize` on it (recompute, and the mesh +
    each axis's step when asked for) and the MoE aids; record and log what applied. Returns the model to train.
    A model this run prepared already is returned as it is."""
    if run.prepared(model):
        return model
    run.report = apply.apply_to_model(model, run.config)
    applied = [op for op, n in run.report.get("kernels", {}).items() if n]
    logger.info("mindspeed_hf: %s runs %s with kernels %s (backend %s); recompute %s", run.owner,
                type(model).__name__, ", ".join(applied) or "none", run.report.get("backend"),
                _recompute_state(model, run.config))
    dims = ensure_dims(run)
    options = ParallelizeOptions(param_dtype=run.param_dtype if dims else None,
                                 layer_classes=run.plan.layer_classes if run.plan else None,
                                 broadcast_from_rank0=bool(run.plan and run.plan.cpu_ram_efficient_loading))
    try:
        model = parallelize(model, dims, run.config, options)
    except ValueError as err:  # a size this model cannot take: the setting as its source gave it
        raise ValueError(_with_source(str(err), run)) from err
    if dims is None:  # data parallelism we do not shard: DDP, DeepSpeed (our FSDP2 steps keep the towers in step)
        _keep_towers_in_step(model)
    install_loop_split(model)
    absorb_hf_checkpointing(model, run.args, run.config.memory)  # applied: Trainer.train must not again
    for previous in (run.moe_load, run.moe_balance):  # a model given again (model_init's re-init at train())
        if previous is not None:
            previous.remove()
    run.moe_load = ExpertLoad.attach(model, _load_history(run)) if run.config.moe.log_load and run.args else None
    run.moe_balance = AuxFreeBalance.attach(model, run.config)
    if dims is not None:
        _log_sharded(run)
    run.models.add(model)
    return model


def _with_source(message: str, run: Run) -> str:
    """A refusal that starts with `parallel.<key>=<value>` (parallel/'s steps know the model, not the sources) with
    that setting as its source spells it and the source named (`parallel.ep=2 (config file 'x.yaml')`)."""
    match = re.match(r"(parallel\.\w+)=\S+?(?=[:;,) ]|$)", message)
    if match is None or not run.resolved.is_set(match.group(1)):
        return message
    return run.resolved.describe(match.group(1)) + message[match.end():]


def _load_history(run: Run) -> str | None:
    """A trainer's expert-load history file (OUTPUT_DIR/moe_load.jsonl, written by the main process)."""
    args = run.args
    if getattr(args, "process_index", 0) != 0 or not getattr(args, "output_dir", None):
        return None
    return os.path.join(args.output_dir, ExpertLoad.HISTORY)


def _log_sharded(run: Run) -> None:
    """After parallelize: say what was built."""
    p = run.config.parallel
    dims = run.dims
    ep = f" ep={dims.ep} (efsdp={dims.efsdp_size})" if dims.ep_enabled else ""
    ep += f" cp={dims.cp}" if dims.cp_enabled else ""
    ep += f" tp={dims.tp}" if dims.tp_enabled else ""
    what = "FSDP2" if dims.dp_replicate * dims.fsdp_size > 1 else "tensor parallelism"
    if dims.tp_enabled and what == "FSDP2":
        what += " x tensor parallelism"
    logger.info("mindspeed_hf: %s on %s (requested by %s): dp_replicate=%d dp_shard=%d%s, reshard_after_forward=%s,"
                " cpu_offload=%s, param dtype %s", what, run.device_type, "; ".join(run.plan.sources),
                dims.dp_replicate, dims.dp_shard, ep, p.reshard_after_forward, p.cpu_offload,
                run.param_dtype or "as stored")


def _keep_towers_in_step(model: nn.Module) -> None:
    """On more than one rank without our FSDP2 (DDP, DeepSpeed ZeRO), a rank whose rows lack a medium another rank has
    would still skip collectives of that tower: DDP's gradient reduction (it hangs without find_unused_parameters,
    which gradient checkpointing turns off), ZeRO-1/2's gradient buckets, ZeRO-3's weight gathers.
    parallel/towers.py's placeholders keep those ranks in step, as under our FSDP2."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    hf_model = apply.find_hf_model(model)
    if not (hf_model is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            and tower_modules(hf_model)):
        return
    # the flags' all-gather runs where the backend does
    device = torch.device("cpu") if dist.get_backend() == "gloo" else torch.device(detect_device_type(), local_rank())
    # ZeRO-3 gathers weights in every forward, DDP and ZeRO-1/2 reduce gradients only
    installed = keep_media_in_step(model, hf_model, device, gradients_only=not is_deepspeed_zero3_enabled())
    if installed is not None:
        logger.info("mindspeed_hf: %d ranks train %s: the ranks' media compared each step; %s",
                    dist.get_world_size(), type(hf_model).__name__,
                    "a rank lacking a medium another rank has runs that tower on a placeholder"
                    if installed == "placeholders" else "different media stop the step in one line")


def _recompute_state(model: nn.Module, config: Any) -> str:
    """What recomputes on `model`: ours (memory.recompute), HF's checkpointing switched on the model itself (as
    LLaMA-Factory does before it builds the Trainer), or nothing."""
    if config.memory.recompute:
        return f"on ({config.memory.recompute_mode})"
    hf_model = apply.find_hf_model(model)
    if hf_checkpointing_on(hf_model):
        return "on (Hugging Face gradient checkpointing, switched on the model)"
    return "off"
