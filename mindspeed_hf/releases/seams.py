"""Every private name of transformers, accelerate, PEFT, TRL and torch the package uses, in one list.

The integration keeps Trainer's own code paths (checkpoint writing, rotation, RNG state, best-model tracking) and
adds ours around them; where it must replace a private method, or read or set a private attribute - of the Trainer,
of a model, config or attention registry, or of torch - the name is listed here with the reason and dated against
the real wheels (`since` / `until`: the first release of the owning package that has it / no longer has it, found
by reading every release's files; torch names are dated from the oldest supported torch, 2.6, and checked against
the installed one). A private name used in more than one module goes through one accessor in
mindspeed_hf/releases/compat.py (`accessor`), so it appears in one place.

A seam with a `without` note is optional: releases that lack it take another path with the same result (the note
says which), and the code asks `available(name)` before using it. A seam with a `feature` is used only by that
feature (a tool, a parallelism): enable() does not ask for it. Any other seam is required: one that the installed
release lacks makes `problems()` name it; enable() checks that before it changes anything, so an unservable release
is refused with one line and nothing patched. tests/trainer/test_seams.py checks each name against the installed
packages by its dates, and scans the package for private names that are not listed.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import linecache
from dataclasses import dataclass
from typing import Any

from packaging.version import Version

__all__ = ["PACKAGES", "SEAMS", "Seam", "available", "check", "missing", "problems"]

#: The packages whose private names may be seams (diffusers: optional, the `diffusion` extra).
PACKAGES = ("transformers", "accelerate", "peft", "trl", "torch", "diffusers")


@dataclass(frozen=True)
class Seam:
    """One private name we use.

    `kind`, for the Trainer: "method" (a Trainer method we wrap or replace), "attribute" (a name Trainer's own code
    reads, found in its source), "module" (a name in transformers.trainer), "arguments" (a TrainingArguments
    member), "accelerate" (a method of an accelerate class, `Class._name`). For any other object (a model class, a
    config, a registry, torch), `owner` is the import path of the object that holds the name and `kind` says how to
    find it there: "object" (an attribute of it), "instance" (an attribute of an instance made without arguments:
    names set in `__init__`), "source" (named in the owner module's source: attributes the package sets on objects
    at run time)."""

    name: str
    kind: str
    why: str
    since: str = "4.57"  # first release of `package` (in our range) that has it
    until: str | None = None  # first release that no longer has it (the seam is then not used)
    without: str | None = None  # optional: what releases without it do instead (same result)
    package: str = "transformers"  # the package the name belongs to (PACKAGES)
    owner: str | None = None  # import path of the object holding the name (kinds object / instance / source)
    feature: str | None = None  # the only feature that uses it: not asked of the installed release by enable()
    accessor: str | None = None  # the compat.py function that is the one place the name is used

    @property
    def attribute(self) -> str:
        """The private name itself (`_global_mapping` of "AttentionInterface._global_mapping")."""
        return self.name.rsplit(".", 1)[-1]

    @property
    def required(self) -> bool:
        """A release within the seam's dates that lacks it cannot be served (there is no other path)."""
        return self.without is None and self.feature is None


SEAMS: tuple[Seam, ...] = (
    # wrapped: Trainer's own body runs, ours runs around it
    Seam("create_accelerator_and_postprocess", "method",
         "accelerator created without accelerate's FSDP plugin (we shard); it keeps our sharded model unwrapped"),
    Seam("evaluation_loop", "method", "groups left gathered by an evaluation forward are resharded afterwards"),
    Seam("save_model", "method",
         "a sharded model's weights written first, on every rank (consolidated safetensors, or model shards (DCP) in "
         "a checkpoint); then Trainer's own save_model runs, its weight writer (model.save_pretrained) a no-op"),
    Seam("_save_checkpoint", "method",
         "Trainer writes the checkpoint (every run); we mark it COMPLETE once every rank is done, then let Trainer's "
         "rotation run (checkpoints.py)"),
    Seam("_rotate_checkpoints", "method",
         "Trainer's rotation, held back until the new checkpoint is COMPLETE (later releases: rotate_checkpoints)",
         until="5.2"),
    # replaced while the model is FSDP2-sharded: Trainer's versions would treat DTensors as whole tensors
    Seam("_save_optimizer_and_scheduler", "method", "optimizer shards through DCP, not one rank's torch.save"),
    Seam("_load_from_checkpoint", "method", "model shards read back through DCP"),
    Seam("_load_optimizer_and_scheduler", "method", "optimizer shards read back through DCP"),
    Seam("_load_best_model", "method", "the best checkpoint's shards read back into the sharded model"),
    Seam("_move_model_to_device", "method", "a sharded model owns its placement (`.to()` would undo cpu_offload)"),
    Seam("_defer_fsdp_gradient_reduction", "method",
         "gradient accumulation reduces once per step (HSDP: reduce-scatter per micro-batch, all-reduce once)",
         since="5.23", without="every micro-batch is reduced, which gives the same result"),
    # read by Trainer's own code
    Seam("is_distributed_loading_by_transformers", "attribute",
         "set on the trainer of a sharded model: Trainer then leaves placement and gradient reduction to the model",
         since="5.19", without="the accelerator's prepare_model keeps the model as sharded (runtime/accelerator.py) "
                               "and _move_model_to_device leaves its placement"),
    Seam("_is_fsdp_managed_module", "attribute",
         "set on a sharded model: generate() keeps the ranks in step and accumulation defers the reduction"),
    # transformers.trainer module names
    Seam("apply_liger_kernel", "module",
         "made a no-op during train() for a model we accelerate (so Liger does not patch the same layers)",
         since="5.2", without="Liger is applied in Trainer.__init__; use_liger_kernel with our kernels is refused"),
    Seam("rotate_checkpoints", "module",
         "Trainer's rotation, held back during a checkpoint save until the new checkpoint is COMPLETE, so "
         "save_total_limit never deletes the last complete checkpoint", since="5.2",
         without="the trainer's _rotate_checkpoints method is held back instead"),
    # TrainingArguments internals
    Seam("_setup_devices", "arguments",
         "recomputed once with use_cpu on CPU under torchrun, so accelerate counts every process (use_cpu is given "
         "back afterwards)"),
    Seam("__post_init__", "arguments",
         "wrapped (DeepSpeed, trainers/deepspeed.py): our parallelism with DeepSpeed refused and use_cpu set for a "
         "CPU launch before the devices are set up; deepspeed.comm initialised after, before a ZeRO-3 model is built"),
    # accelerate internals (read in every release 1.10.1 .. 1.15.0)
    Seam("AcceleratorState._reset_state", "accelerate",
         "drop an FSDP plugin an earlier Accelerator left in accelerate's process-wide state (runtime/accelerator.py)",
         since="1.10",
         package="accelerate"),
    Seam("AcceleratorState._shared_state", "object",
         "read to see whether an earlier Accelerator left an FSDP plugin / ParallelismConfig in the process-wide "
         "state (runtime/accelerator.py)", since="1.10", package="accelerate",
         owner="accelerate.state.AcceleratorState"),
    Seam("Accelerator._prepare_device_mesh", "accelerate",
         "context / tensor parallelism: data loaders prepared over our world mesh, so a cp or tp group shares its "
         "batches (runtime/accelerator.py)", since="1.10", package="accelerate"),
    Seam("PartialState._shared_state", "object",
         "read to see whether accelerate's process state was set up before without the other processes of a CPU "
         "launch (runtime/accelerator.py)", since="1.10", package="accelerate",
         owner="accelerate.state.PartialState"),
    Seam("Accelerator._models", "source",
         "a sharded run's models left out of accelerate's own save_state / load_state while we write and read "
         "their DCP shards (runtime/accelerator.py)", since="1.10", package="accelerate",
         owner="accelerate.accelerator"),
    Seam("Accelerator._optimizers", "source",
         "their optimizers likewise (runtime/accelerator.py)", since="1.10", package="accelerate",
         owner="accelerate.accelerator"),
    Seam("_is_accelerate_prepared", "source",
         "a model accelerate prepared already is passed on as it is (runtime/accelerator.py)", since="1.10",
         package="accelerate", owner="accelerate.accelerator"),
    Seam("fsdp_plugin_args", "source",
         "masked while our accelerator is made, so accelerate builds no FSDP plugin (trainers/fsdp.py; not "
         "underscored, but TrainingArguments sets it in __post_init__, undocumented)", since="5.0",
         owner="transformers.training_args",
         without="4.57's TrainingArguments build no FSDP plugin arguments: there is nothing to mask"),
    # model level: PreTrainedModel and its configs (modeling_utils.py, configuration_utils.py of every release)
    Seam("PretrainedConfig._attn_implementation", "object",
         "the attention a model runs: read to tell ours from HF's and to report it (patches/apply.py, "
         "patches/multimodal.py, trainers/frameworks.py)", owner="transformers.PretrainedConfig",
         accessor="attn_implementation"),
    Seam("PretrainedConfig._experts_implementation", "object",
         "the experts implementation a MoE model runs (patches/experts.py)", since="5.0",
         owner="transformers.PretrainedConfig", accessor="experts_implementation"),
    Seam("PreTrainedModel._supports_sdpa", "object",
         "our attention replaces sdpa by default only where the model supports sdpa (patches/apply.py)",
         owner="transformers.PreTrainedModel"),
    Seam("PreTrainedModel._supports_attention_backend", "object",
         "whether a model reaches attention through AttentionInterface (4.57's Qwen2-MoE does not; compat.py)",
         owner="transformers.PreTrainedModel"),
    Seam("PreTrainedModel._can_set_experts_implementation", "object",
         "our experts kernel is the default only for models that can switch experts implementation "
         "(patches/experts.py)", since="5.0", owner="transformers.PreTrainedModel"),
    Seam("PreTrainedModel._no_split_modules", "object",
         "the decoder-layer classes FSDP2 shards one group each (parallel/fsdp.py)",
         owner="transformers.PreTrainedModel", feature="FSDP2 sharding (parallel/fsdp.py)"),
    Seam("PreTrainedModel._from_config", "object",
         "a model built on the meta device from its config before sharded loading (parallel/loading.py; "
         "PreTrainedModel has no public from_config, only the Auto classes)", owner="transformers.PreTrainedModel",
         feature="sharded loading (parallel/loading.py)"),
    Seam("Qwen2_5OmniAudioEncoder._get_feat_extract_output_lengths", "object",
         "the Omni recipe counts a clip's audio placeholder tokens by the audio tower's own length rule",
         owner="transformers.models.qwen2_5_omni.modeling_qwen2_5_omni.Qwen2_5OmniAudioEncoder",
         feature="mindspeed-hf train --recipe omni (recipes/omni_data.py)"),
    Seam("PreTrainedModel._init_weights", "object",
         "recomputes non-persistent buffers (rotary inv_freq) after meta init (parallel/loading.py)",
         owner="transformers.PreTrainedModel", feature="sharded loading (parallel/loading.py)"),
    Seam("_is_hf_initialized", "source",
         "the flag that makes _init_weights skip a tensor: dropped so the buffers are recomputed (parallel/loading.py)",
         owner="transformers.modeling_utils", feature="sharded loading (parallel/loading.py)"),
    Seam("_tp_size", "source",
         "set on a model transformers sharded itself (tp_plan / DistributedConfig tp_size): tensor parallelism refuses "
         "to shard it twice (parallel/parallelize.py)", owner="transformers.modeling_utils",
         feature="tensor parallelism (parallel/parallelize.py)"),
    Seam("_is_expert_parallel", "source",
         "marks the experts transformers split itself (distributed_config ep_size), adopted by parallelize "
         "(parallel/expert.py)", since="5.18", owner="transformers.integrations.moe",
         without="no module carries the mark: native_expert_parallel finds none and our expert parallelism shards"),
    # attention / mask / experts registries (transformers.utils.generic.GeneralInterface in every release)
    Seam("AttentionInterface._global_mapping", "object",
         "our attentions registered and removed again (ops/attention.py, parallel/context)",
         owner="transformers.AttentionInterface", accessor="registered"),
    Seam("AttentionMaskInterface._global_mapping", "object", "our mask functions registered and removed again",
         owner="transformers.masking_utils.AttentionMaskInterface", accessor="registered"),
    Seam("ALL_EXPERTS_FUNCTIONS._global_mapping", "object",
         "our experts kernel registered and removed again; a probe name registered for one call", since="5.0",
         owner="transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS", accessor="registered"),
    Seam("ALL_EXPERTS_FUNCTIONS._local_mapping", "instance",
         "our experts kernel removed from the registry's instance mapping too (patches/experts.py)", since="5.0",
         owner="transformers.integrations.moe.ExpertsInterface", accessor="unregister"),
    Seam("moe._default_apply_gate", "object",
         "the gate use_experts_implementation installs: our fused kernel runs only where a module keeps it",
         since="5.0", owner="transformers.integrations.moe"),
    Seam("_apply_gate", "source",
         "an experts module's gate, read to see whether it is the default one (patches/experts.py)", since="5.0",
         owner="transformers.integrations.moe"),
    # torch: nn.Module internals (every torch 2.x)
    Seam("Module._forward_pre_hooks", "instance", "our scope hooks found by their mark and removed (patches/scope.py);"
         " a projection with hooks is not stacked with others (ops/linear.py)", since="2.6", package="torch",
         owner="torch.nn.Module"),
    Seam("Module._forward_hooks", "instance", "our scope hooks found by their mark and removed (patches/scope.py);"
         " a projection with hooks is not stacked with others (ops/linear.py)", since="2.6", package="torch",
         owner="torch.nn.Module"),
    Seam("Module._forward_hooks_always_called", "instance",
         "the always_call flag of a removed scope hook dropped with it (patches/scope.py)", since="2.6",
         package="torch", owner="torch.nn.Module"),
    Seam("Module._buffers", "instance", "a module's own buffers, read and refilled after meta init "
         "(parallel/loading.py)", since="2.6", package="torch", owner="torch.nn.Module",
         feature="sharded loading (parallel/loading.py)"),
    Seam("Module._non_persistent_buffers_set", "instance",
         "which buffers no checkpoint holds (recomputed after meta init, skipped when loading; parallel/loading.py)",
         since="2.6", package="torch", owner="torch.nn.Module", feature="sharded loading (parallel/loading.py)"),
    Seam("Module._modules", "instance",
         "lm_head swapped for a pass-through while a multimodal forward runs (patches/multimodal.py)", since="2.6",
         package="torch", owner="torch.nn.Module", feature="multimodal fused loss (patches/multimodal.py)"),
    Seam("Module._parameters", "instance",
         "a module's DTensor parameters swapped for their local tensors while it runs (parallel/tensor.py)",
         since="2.6", package="torch", owner="torch.nn.Module", feature="tensor parallelism (parallel/tensor.py)"),
    Seam("module._global_forward_hooks", "object", "a norm or projection with a global forward hook keeps HF's "
         "call (the fused add + RMSNorm or stacked projections would skip it; compat.global_module_hooks)",
         since="2.6", package="torch", owner="torch.nn.modules.module"),
    Seam("module._global_forward_pre_hooks", "object", "as _global_forward_hooks (compat.global_module_hooks)",
         since="2.6", package="torch", owner="torch.nn.modules.module"),
    # torch: tensors and storages
    Seam("Tensor._base", "object", "deferred logits answer FSDP2's view check on a forward's outputs without being "
         "computed (patches/lazy_logits.py); gate and up, views of one stacked output, reach npu_swiglu as that "
         "output (ops/linear.py halves_of_one)", since="2.6", package="torch", owner="torch.Tensor"),
    Seam("Tensor._version", "object", "a cached mask is reused only while its source tensor was not written "
         "(ops/varlen.py)", since="2.6", package="torch", owner="torch.Tensor"),
    Seam("Tensor._is_view", "object", "views are not offloaded (memory/offload.py)", since="2.6", package="torch",
         owner="torch.Tensor", feature="activation offload (memory/offload.py)"),
    Seam("Tensor._make_wrapper_subclass", "object", "deferred logits: a tensor with HF's logits' shape, dtype and "
         "device and no storage, computed on first use (patches/lazy_logits.py)", since="2.6", package="torch",
         owner="torch.Tensor"),
    Seam("UntypedStorage._cdata", "object",
         "a storage's identity (memory/offload.py, memory/measure.py, bench/memory_report.py, bench/counts.py)",
         since="2.6", package="torch", owner="torch.UntypedStorage",
         feature="activation offload and memory measurement", accessor="storage_key"),
    Seam("torch._C", "object", "torch's C extension module, for the names below", since="2.6", package="torch",
         owner="torch"),
    Seam("torch._C._storage_Use_Count", "object", "whether a storage is used outside the offloaded activation "
         "(memory/offload.py)", since="2.6", package="torch", owner="torch._C",
         feature="activation offload (memory/offload.py)"),
    Seam("torch._C._current_autograd_node", "object", "backward op counts of `mindspeed-hf bench` "
         "(bench/counts.py); a forward rerun in backward by recompute is not counted again in the MoE load "
         "(moe/load.py)", since="2.6", package="torch", owner="torch._C", accessor="current_autograd_node"),
    Seam("torch.utils.checkpoint._CachingTorchDispatchMode", "object", "selective activation checkpointing's forward "
         "mode: the rope's per-forward tables are made per call inside it (ops/rotary.py)", since="2.6",
         package="torch", owner="torch.utils.checkpoint",
         without="every dispatch mode is taken for it: the tables are made per call under any (same results)"),
    Seam("torch.utils.checkpoint._CachedTorchDispatchMode", "object", "selective activation checkpointing's recompute "
         "mode (ops/rotary.py, as above)", since="2.6", package="torch", owner="torch.utils.checkpoint",
         without="every dispatch mode is taken for it: the tables are made per call under any (same results)"),
    Seam("torch._C._len_torch_dispatch_stack", "object", "whether a dispatch mode is on (ops/rotary.py, as above)",
         since="2.6", package="torch", owner="torch._C"),
    Seam("torch._C._get_dispatch_stack_at", "object", "which dispatch modes are on (ops/rotary.py, as above)",
         since="2.6", package="torch", owner="torch._C"),
    Seam("torch._C._dispatch_key_for_device", "object", "which bitsandbytes kernel runs, for report() "
         "(patches/quantized.py)", since="2.6", package="torch", owner="torch._C",
         feature="report() of quantized models"),
    Seam("torch._C._dispatch_has_kernel_for_dispatch_key", "object", "which bitsandbytes kernel runs, for report() "
         "(patches/quantized.py)", since="2.6", package="torch", owner="torch._C",
         feature="report() of quantized models"),
    # torch: kernels and distributed internals
    Seam("torch._grouped_mm", "object", "the grouped GEMM of our experts kernel (ops/experts.py)", since="2.6",
         package="torch", owner="torch", without="the per-expert loop runs, which gives the same result"),
    Seam("aten._scaled_dot_product_flash_attention_for_cpu", "object",
         "ring attention blocks on CPU: the fused kernel with its logsumexp (parallel/context/blocks.py)",
         since="2.6", package="torch", owner="torch.ops.aten", feature="context parallelism"),
    Seam("aten._scaled_dot_product_flash_attention_for_cpu_backward", "object",
         "ring attention blocks on CPU, backward (parallel/context/blocks.py)", since="2.6", package="torch",
         owner="torch.ops.aten", feature="context parallelism"),
    Seam("aten._scaled_dot_product_flash_attention", "object",
         "ring attention blocks on cuda: the flash kernel with its logsumexp (parallel/context/blocks.py)",
         since="2.6", package="torch", owner="torch.ops.aten", feature="context parallelism"),
    Seam("aten._scaled_dot_product_flash_attention_backward", "object",
         "ring attention blocks on cuda, backward (parallel/context/blocks.py)", since="2.6", package="torch",
         owner="torch.ops.aten", feature="context parallelism"),
    Seam("DeviceMesh._flatten", "object", "the flattened dp / dp_shard_cp / dp_cp meshes (parallel/dims.py)",
         since="2.6", package="torch", owner="torch.distributed.device_mesh.DeviceMesh",
         feature="FSDP2 / context / expert parallelism meshes"),
    Seam("DeviceMesh._unflatten", "object", "the cp_ring x cp_ulysses, hsdp and expert meshes (parallel/dims.py)",
         since="2.6", package="torch", owner="torch.distributed.device_mesh.DeviceMesh",
         feature="FSDP2 / context / expert parallelism meshes"),
    Seam("_StridedShard", "object", "FSDP's placement over expert parallelism's Shard(0), read back when loading "
         "(parallel/loading.py)", since="2.6", package="torch", owner="torch.distributed.tensor.placement_types",
         without="no such placement exists: every placement is a plain Shard or Replicate"),
    Seam("PreTrainedModel._check_and_adjust_attn_implementation", "object",
         "wrapped per family: with kernels.take_flash_attention an explicit flash_attention_2/3 request is ours before "
         "transformers looks for the flash_attn package or a hub kernel (patches/apply.py)",
         owner="transformers.PreTrainedModel", feature="kernels.take_flash_attention"),
    # diffusers (the `diffusion` extra; dated against 0.42.1, the release tested)
    Seam("_AttentionBackendRegistry", "object",
         "diffusers' attention backend registry, read to tell the default backend from one the user chose "
         "(patches/diffusion)", since="0.42.1", package="diffusers", owner="diffusers.models.attention_dispatch",
         feature="diffusion"),
    Seam("_AttentionBackendRegistry._active_backend", "object",
         "the backend diffusers' dispatcher runs now (patches/diffusion)", since="0.42.1", package="diffusers",
         owner="diffusers.models.attention_dispatch._AttentionBackendRegistry", feature="diffusion"),
    Seam("_attention_backend", "source",
         "an attention processor's own backend (set_attention_backend), kept when the user chose it "
         "(patches/diffusion)", since="0.42.1", package="diffusers", owner="diffusers.models.attention_processor",
         feature="diffusion"),
    Seam("_parallel_config", "source",
         "a processor's cp config: our DenoiserContext is set there, so the attention over the split sequence runs "
         "over the cp group (parallel/context/denoiser.py, patches/diffusion/wan.py)", since="0.42.1",
         package="diffusers", owner="diffusers.models.transformers.transformer_wan", feature="diffusion"),
    Seam("FluxTransformer2DModel._cp_plan", "object",
         "where a denoiser's sequence is split and gathered under cp (parallel/context/denoiser.py)", since="0.42.1",
         package="diffusers", owner="diffusers.FluxTransformer2DModel", feature="diffusion"),
    Seam("FluxTransformer2DModel._repeated_blocks", "object",
         "a denoiser's transformer blocks, for an unlisted model (patches/diffusion/model.py)", since="0.42.1",
         package="diffusers", owner="diffusers.FluxTransformer2DModel", feature="diffusion"),
    Seam("_get_qkv_projections", "object",
         "Wan's q/k/v projections (fused, PEFT-wrapped) called by our processor call (patches/diffusion/wan.py)",
         since="0.42.1", package="diffusers", owner="diffusers.models.transformers.transformer_wan",
         feature="diffusion"),
    Seam("_get_added_kv_projections", "object",
         "Wan image-to-video's image k/v projections, likewise (patches/diffusion/wan.py)", since="0.42.1",
         package="diffusers", owner="diffusers.models.transformers.transformer_wan", feature="diffusion"),
    # torch.distributed: what the hang watch reads (runtime/watchdog.py), from its own thread
    Seam("ProcessGroup._get_sequence_number_for_group", "object",
         "the collectives a rank has issued (gloo, nccl, hccl count one when it is issued): a rank behind the others "
         "is named (runtime/watchdog.py)", since="2.6", package="torch", owner="torch.distributed.ProcessGroup",
         without="the step alone tells a rank behind (runtime/watchdog.py counts the step instead)"),
    Seam("distributed_c10d._world", "object", "the process groups of this process, whose collectives are counted "
         "(runtime/watchdog.py)", since="2.6", package="torch", owner="torch.distributed.distributed_c10d",
         without="the step alone tells a rank behind"),
    Seam("distributed_c10d._get_default_store", "object", "the store the default process group was set up with: "
         "the hang watch's heartbeats go there (runtime/watchdog.py)", since="2.6", package="torch",
         owner="torch.distributed.distributed_c10d", feature="the hang watch (parallel.collective_timeout)"),
)


def _installed(package: str) -> Version | None:
    """The installed release of `package` (a local suffix such as torch's "+cpu" kept: it compares after); None for
    an optional package that is not installed (diffusers)."""
    try:
        return Version(importlib.import_module(package).__version__)
    except ImportError:
        return None


def _transformers_version() -> Version:
    return _installed("transformers")


# Where transformers reads the attributes we set: the Trainer, and its FSDP helpers (moved in 5.0).
_READERS = ("transformers.trainer", "transformers.distributed.fsdp", "transformers.integrations.fsdp")


def _resolve(path: str) -> Any:
    """The object at import path `path` ("torch.nn.Module", "transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS"):
    the longest importable module, then attributes; None when any part is missing."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            found = getattr(found, part, None)
        return found
    return None


def source_of(obj: Any) -> str:
    """`inspect.getsource(obj)`, without leaving its file's lines in linecache where nothing else had put them: a
    check that reads HF's source once must not keep that file (transformers' trainer.py: over 1 MB as lines) in memory
    for the whole run. Raises what inspect.getsource raises."""
    try:
        file = inspect.getsourcefile(obj)
    except TypeError:
        file = None
    cached = file is None or file in linecache.cache
    try:
        return inspect.getsource(obj)
    finally:
        if not cached:
            linecache.cache.pop(file, None)


@functools.cache
def _source_has(module: str, text: str) -> bool:
    """Whether the source file of module `module` holds `text` (False when it cannot be imported or read); the file
    is read as it is, and not kept."""
    try:
        with open(importlib.import_module(module).__file__, encoding="utf-8") as f:
            return text in f.read()
    except (ImportError, OSError, TypeError):
        return False


@functools.cache
def _release(text: str) -> Version:
    return Version(text)


def _present_on_owner(seam: Seam) -> bool:
    """Kinds object / instance / source: the name on (an instance of, the source of) `seam.owner`."""
    if seam.kind == "source":
        return _source_has(seam.owner, seam.attribute)
    owner = _resolve(seam.owner)
    if owner is None:
        return False
    if seam.kind == "instance":
        owner = owner()
    return hasattr(owner, seam.attribute)


def _present(seam: Seam) -> bool:
    if seam.owner is not None:
        return _present_on_owner(seam)
    if seam.kind == "method":
        from transformers import Trainer

        return callable(getattr(Trainer, seam.name, None))
    if seam.kind == "attribute":
        return any(_source_has(module, seam.name) for module in _READERS)
    if seam.kind == "module":
        import transformers.trainer as hf_trainer

        return callable(getattr(hf_trainer, seam.name, None))
    if seam.kind == "arguments":
        from transformers import TrainingArguments

        return seam.name in vars(TrainingArguments)
    owner, attribute = seam.name.split(".")
    import accelerate
    import accelerate.state

    cls = getattr(accelerate.state, owner, None) or getattr(accelerate, owner, None)
    return callable(getattr(cls, attribute, None))


def in_range(seam: Seam, version: Version | None = None) -> bool:
    """Whether the installed release of the seam's package (`version` for transformers when given) lies within
    the seam's dates."""
    if seam.package != "transformers" or version is None:
        version = _installed(seam.package)
    if version is None:  # an optional package that is not installed: nothing of it is used
        return False
    release = Version(version.base_version)
    return release >= _release(seam.since) and (seam.until is None or release < _release(seam.until))


# Seams read off transformers' Trainer and TrainingArguments: checking them imports the Trainer (and PEFT,
# bitsandbytes, datasets with it), which enable() leaves to the first import of transformers.trainer.
_TRAINER_KINDS = ("method", "attribute", "module", "arguments")


def of_trainer(seam: Seam) -> bool:
    """Whether `seam` belongs to transformers' Trainer or its arguments."""
    return seam.kind in _TRAINER_KINDS or (seam.owner or "").startswith(("transformers.trainer",
                                                                          "transformers.training_args"))


def missing(version: Version | None = None, required_only: bool = False, trainer: bool = True) -> list[Seam]:
    """The seams the installed releases should have (by their dates) but do not, optional ones included unless
    `required_only`, the Trainer's unless `trainer` is False. `version` stands for the installed transformers
    release."""
    chosen = [s for s in SEAMS if (s.required or not required_only) and (trainer or not of_trainer(s))]
    return [s for s in chosen if in_range(s, version) and not _present(s)]


def available(name: str) -> bool:
    """True when the installed release has seam `name` (feature detection; an optional seam is otherwise not
    used, and its `without` path runs)."""
    return _present(next(s for s in SEAMS if s.name == name))


def _owner(seam: Seam) -> str:
    """The package and installed release a seam belongs to, e.g. "accelerate 1.15.0"."""
    return f"{seam.package} {importlib.import_module(seam.package).__version__}"


def problems(trainer: bool = True) -> str | None:
    """One line naming every required seam the installed releases lack (None when all are there), the Trainer's
    only if `trainer`. Changes nothing: enable() asks before it patches anything."""
    gone = missing(required_only=True, trainer=trainer)
    if not gone:
        return None
    names = "; ".join(f"{_owner(s)} no longer has {s.name} ({s.why})" for s in gone)
    return (f"mindspeed_hf: {names}; this release of mindspeed_hf supports transformers 4.57 to 5.x, accelerate "
            "1.10 to 1.x and torch 2.6 or later - install one of those, or set MINDSPEED_HF_AUTO=0 to run without "
            "the accelerator")


def check() -> None:
    """Raise RuntimeError with problems() when a required seam is gone."""
    message = problems()
    if message is not None:
        raise RuntimeError(message)
