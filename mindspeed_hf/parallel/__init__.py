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

from ..lazy_exports import lazy_exports, public_names

# the entry point, imported with the package: its name is also its module's, which importing the module would
# otherwise bind here in the function's place
from .parallelize import ParallelizeOptions, parallelize, register_step_override  # noqa: F401 (in __all__)

#: each module of this package -> its public names, imported on first use
_MODULES: dict[str, tuple[str, ...]] = {
    "checkpoint": (
        "COMPLETE_MARKER", "capture_rng_state", "is_complete_checkpoint", "latest_complete_checkpoint",
        "load_model_shards", "load_optimizer_shards", "load_sharded", "mark_complete", "restore_rng_state",
        "save_hf_consolidated", "save_model_shards", "save_optimizer_shards", "save_sharded", "unmark",
    ),
    "context": ("context_of", "context_parallel_from", "split_cp_batch"),
    "dims": ("ParallelDims", "expert_mesh", "fsdp_mesh", "init_distributed", "quiesce_gloo_at_exit"),
    "expert": (
        "apply_expert_parallel", "check_expert_parallel", "clip_grad_norm_", "find_fused_experts",
        "remove_expert_parallel",
    ),
    "fsdp": (
        "apply_fsdp", "defer_gradient_reduction", "find_decoder_layers", "get_fsdp_parts", "local_state_bytes",
        "reshard_model", "unwrap_hf_model",
    ),
    "loading": (
        "build_meta_model", "from_pretrained_sharded", "init_nonpersistent_buffers", "load_sharded_safetensors",
        "local_shard_slices", "materialize_meta_model",
    ),
}

__all__ = sorted([*public_names(_MODULES), "ParallelizeOptions", "parallelize", "register_step_override"])
__getattr__, __dir__ = lazy_exports(__name__, _MODULES)
