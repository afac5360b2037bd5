"""Distributed building blocks: device mesh, FSDP2, sharded loading and checkpoints.

Small functions, usable from a plain training loop or from the Trainer integration::

    from mindspeed_hf.parallel import ParallelDims, init_distributed, fsdp_mesh, apply_fsdp

    device = init_distributed("cpu")                 # gloo / nccl / hccl from the device type
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, world_size=world)
    mesh = dims.build_mesh(device.type)              # named axes + flattened views
    model = apply_fsdp(model, fsdp_mesh(mesh, dims), param_dtype=torch.bfloat16)

or load straight into shards: ``from_pretrained_sharded(path, fsdp_mesh(mesh, dims))``.
``parallelize(model, dims, config)`` applies the parallel and memory steps in order (parallelize.py); expert
parallelism (``parallel.ep``) is its first step (expert.py), and ``clip_grad_norm_`` clips gradients that live on
the dense and the expert meshes together. Context parallelism (``parallel.cp``) is the cp step: the model's attention
runs over the cp group, and each batch goes through ``split_cp_batch(batch, context_of(model))``.
Checkpoints: ``save_hf_consolidated`` (HF directory / PEFT adapter), ``save_sharded`` /
``load_sharded`` (DCP, atomic ``COMPLETE`` marker) and ``latest_complete_checkpoint``.
Each name is imported from its module on first use (PEP 562), so a run loads the steps it applies, not the
whole package.
"""

from ..lazy_exports import lazy_exports

# the entry point, imported with the package: its name is also its module's, which importing the module would
# otherwise bind here in the function's place
from .parallelize import ParallelizeOptions, parallelize, register_step_override  # noqa: F401 (in __all__)

#: public name -> the module of this package that defines it
_EXPORTS: dict[str, str] = {
    "COMPLETE_MARKER": "checkpoint",
    "capture_rng_state": "checkpoint",
    "is_complete_checkpoint": "checkpoint",
    "latest_complete_checkpoint": "checkpoint",
    "load_model_shards": "checkpoint",
    "load_optimizer_shards": "checkpoint",
    "load_sharded": "checkpoint",
    "mark_complete": "checkpoint",
    "restore_rng_state": "checkpoint",
    "save_hf_consolidated": "checkpoint",
    "save_model_shards": "checkpoint",
    "save_optimizer_shards": "checkpoint",
    "save_sharded": "checkpoint",
    "unmark": "checkpoint",
    "context_of": "context",
    "context_parallel_from": "context",
    "split_cp_batch": "context",
    "ParallelDims": "dims",
    "expert_mesh": "dims",
    "fsdp_mesh": "dims",
    "init_distributed": "dims",
    "quiesce_gloo_at_exit": "dims",
    "apply_expert_parallel": "expert",
    "check_expert_parallel": "expert",
    "clip_grad_norm_": "expert",
    "find_fused_experts": "expert",
    "remove_expert_parallel": "expert",
    "apply_fsdp": "fsdp",
    "defer_gradient_reduction": "fsdp",
    "find_decoder_layers": "fsdp",
    "get_fsdp_parts": "fsdp",
    "local_state_bytes": "fsdp",
    "reshard_model": "fsdp",
    "unwrap_hf_model": "fsdp",
    "build_meta_model": "loading",
    "from_pretrained_sharded": "loading",
    "init_nonpersistent_buffers": "loading",
    "load_sharded_safetensors": "loading",
    "local_shard_slices": "loading",
    "materialize_meta_model": "loading",
}

__all__ = sorted([*_EXPORTS, "ParallelizeOptions", "parallelize", "register_step_override"])
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
