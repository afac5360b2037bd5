"""parallelize(model, dims, config): the one place that applies the parallel and memory features to a model.

The steps run in this order, each a small function `step(model, dims, config, options) -> model`:

    0. tp          parallel.tp > 1: Megatron-style column / row sharding of the projections over the tp mesh, from
                   the family's base_model_tp_plan, with sequence-parallel norms (parallel/tensor.py); refused
                   for a model already tensor-parallel (transformers' tp_plan="auto": DTensor parameters)
    1. ep          parallel.ep > 1: each fused experts module keeps E/ep experts (DTensor Shard(0) on the ep mesh)
                   and exchanges tokens with the other ep ranks (parallel/expert.py)
       cp          parallel.cp > 1: attention runs over the cp group (ring / Ulysses / hybrid,
                   parallel/context/model.py); each batch then goes through split_cp_batch; a diffusers
                   denoiser splits its image / video tokens itself by its _cp_plan (parallel/context/denoiser.py)
    2. recompute   memory.recompute*: non-reentrant activation checkpointing, full or selective
       offload     memory.offload_*: asynchronous activation offload of the chosen decoder layers (memory/offload.py)
    3. fsdp        parallel.*: FSDP2 / HSDP over the mesh `dims` built (the experts on expert_fsdp first, then
                   each decoder layer, the embeddings, the final norm + lm_head, the root),
                   over the data-parallel ranks only (dp_shard x cp, x dp_replicate): under tp the
                   parameters are 2-D DTensors (dp, tp); a multimodal model's rank lacking a medium another
                   rank has then runs that tower on a placeholder (an untested model: one line; parallel/towers.py)

Context parallelism comes before recompute too (it changes what a layer computes); activation offload
comes right after recompute (it wraps what recompute leaves); FSDP2 is always last, since it shards the
parameters the earlier steps placed. A model family can replace a step with its own function
(`register_step_override("qwen3_moe", "fsdp")`), for layouts the generic step does not know.

The Trainer integration calls it from its prepare hook; nothing else in the package shards a model.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import MindSpeedConfig
from ..memory.recompute import apply_recompute_config
from .dims import ParallelDims, fsdp_mesh
from .fsdp import apply_fsdp, unwrap_hf_model

# Each axis's module (and the offload machinery) is imported by its step when that step applies: a run loads the
# axes it uses (`import mindspeed_hf` stays the cost of what runs; docs/host_time.md).

__all__ = ["ParallelizeOptions", "STEPS", "parallelize", "register_step_override"]

logger = logging.getLogger("mindspeed_hf")


@dataclass(frozen=True)
class ParallelizeOptions:
    """What a step needs besides the config: facts of the run, not settings."""

    param_dtype: torch.dtype | None = None  # bf16/fp16 mixed precision of the run (master weights stay fp32)
    layer_classes: tuple[str, ...] | None = None  # classes sharded one group each (default: _no_split_modules)
    broadcast_from_rank0: bool = False  # only rank 0 loaded real weights (cpu_ram_efficient_loading)


Step = Callable[[nn.Module, "ParallelDims | None", MindSpeedConfig, ParallelizeOptions], nn.Module]


def _already_tensor_parallel(hf_model: nn.Module) -> str | None:
    """How a model arrived tensor-parallel (transformers' tp_plan / distributed_config, or DTensor parameters from
    anyone else), or None."""
    if (getattr(hf_model, "_tp_size", None) or 1) > 1:
        return f"transformers already sharded it (tp_plan, tp_size={hf_model._tp_size})"
    dtensors = [n for n, p in hf_model.named_parameters() if isinstance(p, DTensor)]
    if dtensors:
        return f"its parameters are DTensors already ({dtensors[0]}, ...)"
    return None


def apply_tp(model: nn.Module, dims: ParallelDims | None, config: MindSpeedConfig,
             options: ParallelizeOptions) -> nn.Module:
    """Step 0: tensor parallelism, when dims.tp > 1: the projections sharded column / row over the `tp` mesh with
    sequence parallelism (parallel/tensor.py), checked first (check_tensor_parallel: a plan, divisible heads and
    intermediate sizes, untied embeddings). A model that is tensor-parallel already is refused in one line: it
    would be sharded twice."""
    if dims is None or not dims.tp_enabled:
        return model
    hf_model = unwrap_hf_model(model)
    already = _already_tensor_parallel(hf_model)
    if already is not None:
        raise ValueError(f"parallel.tp={dims.tp}: {type(hf_model).__name__} is tensor-parallel already ({already}); "
                         "sharding it twice is refused; valid choices: parallel.tp=1 with a model transformers "
                         "sharded, or load it without tp_plan")
    from .tensor import apply_tensor_parallel, check_tensor_parallel

    check_tensor_parallel(hf_model, dims.tp)
    apply_tensor_parallel(model, dims.get_mesh("tp"), sequence_parallel=True)
    return model


def apply_ep(model: nn.Module, dims: ParallelDims | None, config: MindSpeedConfig,
             options: ParallelizeOptions) -> nn.Module:
    """Step 1: expert parallelism, when parallel.ep > 1: experts sliced on dim 0 over the ep mesh, the experts
    forward replaced by the token exchange (checked first: fused experts, ep dividing their number). A model
    transformers already split with its own DistributedConfig(ep_size=...) is adopted as loaded (its EP and FSDP2),
    not sharded twice; refused in one line where the two settings cannot combine (expert.adopt_native_ep)."""
    if dims is None:
        return model
    from .expert import adopt_native_ep, apply_expert_parallel

    if adopt_native_ep(unwrap_hf_model(model), dims, config.parallel.ep):
        return model
    if not dims.ep_enabled:
        return model
    apply_expert_parallel(unwrap_hf_model(model), dims.get_mesh("ep"))
    return model


def apply_cp(model: nn.Module, dims: ParallelDims | None, config: MindSpeedConfig,
             options: ParallelizeOptions) -> nn.Module:
    """Context parallelism, when dims.cp > 1: the model's attention runs `context_attention` over the cp group
    (ring over cp_ring, Ulysses over cp_ulysses, zigzag per parallel.cp_zigzag; a vision-language model split
    after its vision features are merged, its tower shared per parallel.cp_vision), checked first (heads divisible
    by the Ulysses size, no softcapping or attention dropout). Batches must then be split with split_cp_batch."""
    if dims is None or not dims.cp_enabled:
        return model
    from ..patches import diffusion
    from .context.denoiser import apply_denoiser_context_parallel
    from .context.model import apply_context_parallel, context_parallel_from

    denoiser = diffusion.find_denoiser(model)
    if denoiser is not None:  # a diffusers DiT: its image / video tokens split by its own _cp_plan
        family = diffusion.family_of(denoiser)
        apply_denoiser_context_parallel(denoiser, context_parallel_from(dims, zigzag=False),
                                        family.name if family is not None else type(denoiser).__name__)
        return model
    hf_model = unwrap_hf_model(model)
    pad = getattr(getattr(hf_model.config, "get_text_config", lambda: hf_model.config)(), "pad_token_id", None)
    apply_context_parallel(hf_model, context_parallel_from(dims, config.parallel.cp_zigzag, pad or 0,
                                                           vision=config.parallel.cp_vision))
    return model


def apply_recompute(model: nn.Module, dims: ParallelDims | None, config: MindSpeedConfig,
                    options: ParallelizeOptions) -> nn.Module:
    """Step 2: recompute, when memory.recompute is on: full (whole decoder layers) or selective (the parts of each
    layer memory.recompute_modules names), in the layers memory.recompute_layers picks."""
    apply_recompute_config(model, config.memory)
    return model


def apply_offload(model: nn.Module, dims: ParallelDims | None, config: MindSpeedConfig,
                  options: ParallelizeOptions) -> nn.Module:
    """Activation offload, when memory.offload_activations is on (after recompute, whose checkpoints it wraps;
    before FSDP2, which subclasses the same layers): the layers memory.offload_layers picks, except the last."""
    if config.memory.offload_activations:
        from ..memory.offload_model import apply_offload_config

        apply_offload_config(model, config.memory)
    return model


def _device(dims: ParallelDims) -> torch.device:
    device_type = dims.world_mesh.device_type
    return torch.device("cpu") if device_type == "cpu" else torch.device(device_type,
                                                                         int(os.environ.get("LOCAL_RANK", "0")))


def _any_rank(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t)
    return bool(t.item())


def _broadcast_from_rank0(model: nn.Module, full: dict[str, torch.Tensor] | None, device: torch.device) -> None:
    """Only rank 0 holds real weights (the others meta/empty tensors): copy them into every rank's shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        model.to_empty(device=device)
    set_model_state_dict(model, full or {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buffer in model.buffers():  # non-persistent buffers (rotary inv_freq) are not in any state dict
        dist.broadcast(buffer.data, src=0)


def apply_fsdp2(model: nn.Module, dims: ParallelDims | None, config: MindSpeedConfig,
                options: ParallelizeOptions) -> nn.Module:
    """Step 3: FSDP2 / HSDP over `dims`' mesh (collective), when there is more than one rank to shard over."""
    if dims is None or dims.dp_replicate * dims.fsdp_size == 1:
        return model
    from .expert import expert_fsdp_groups, native_expert_parallel
    from .towers import keep_media_in_step, tower_modules

    if native_expert_parallel(unwrap_hf_model(model)):  # adopted by apply_ep: transformers' FSDP2 is in place
        return model
    device = _device(dims)
    if options.param_dtype is not None:  # sharded master weights stay fp32; FSDP casts them for compute
        for p in model.parameters():
            if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
    sync = options.broadcast_from_rank0 or _any_rank(any(p.is_meta for p in model.parameters()), device)
    full = model.state_dict() if sync and dist.get_rank() == 0 else None
    p = config.parallel
    apply_fsdp(model, fsdp_mesh(dims.world_mesh, dims), param_dtype=options.param_dtype, reduce_dtype=torch.float32,
               reshard_after_forward=p.reshard_after_forward, cpu_offload=p.cpu_offload, prefetch=p.prefetch,
               layer_classes=options.layer_classes,
               pre_shard=expert_fsdp_groups(model, dims.get_mesh("expert_fsdp")) if dims.ep_enabled else ())
    if sync:
        _broadcast_from_rank0(model, full, device)
    if tower_modules(unwrap_hf_model(model)):  # a rank without some medium would skip its tower's collectives
        keep_media_in_step(model, unwrap_hf_model(model), device)
    # transformers' own FSDP2 marker: generate() keeps the ranks in step (synced_gpus), and Trainer's
    # gradient-accumulation path defers the reduction.
    for module in {id(m): m for m in (model, unwrap_hf_model(model))}.values():
        module._is_fsdp_managed_module = True
    if callable(getattr(model, "generate", None)):
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model, "generate")
    return model


#: The steps, in the order they apply.
STEPS: tuple[tuple[str, Step], ...] = (("tp", apply_tp), ("ep", apply_ep), ("cp", apply_cp),
                                      ("recompute", apply_recompute), ("offload", apply_offload),
                                      ("fsdp", apply_fsdp2))
_OVERRIDES: dict[tuple[str, str], Step] = {}


def register_step_override(model_type: str, step: str) -> Callable[[Step], Step]:
    """Decorator: run the decorated function instead of step `step` for models of `model_type`."""
    names = [name for name, _ in STEPS]
    if step not in names:
        raise ValueError(f"no parallelize step {step!r}; valid choices: {', '.join(names)}")

    def register(fn: Step) -> Step:
        _OVERRIDES[(model_type, step)] = fn
        return fn

    return register


def parallelize(model: nn.Module, dims: ParallelDims | None, config: MindSpeedConfig,
                options: ParallelizeOptions | None = None) -> nn.Module:
    """Apply the steps of STEPS to `model` in order and return it (sharded in place).

    Args:
        model: a transformers model, or a PEFT model wrapping one.
        dims: the built ParallelDims (`dims.build_mesh(...)` called), or None for a single process without a
            mesh: then only the memory steps apply.
        config: the settings of this model (its trainer's).
        options: facts of the run the steps need (mixed-precision dtype, layer classes, rank-0 loading).
    """
    options = options or ParallelizeOptions()
    model_type = getattr(getattr(unwrap_hf_model(model), "config", None), "model_type", None)
    for name, step in STEPS:
        model = _OVERRIDES.get((model_type, name), step)(model, dims, config, options)
    return model
