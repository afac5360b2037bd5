"""Context parallelism building blocks: one sequence split across the cp ranks.

- split.py: the sequence splitter (global label shift, padding to a multiple of cp / 2 * cp, contiguous or zigzag
  slices, global position ids, packed-document segment ids) and its inverse.
- ring.py: ring attention (K/V passed around the group, log-sum-exp merge, causal block skipping, zigzag, GQA,
  packed documents) as an autograd function.
- ulysses.py: the Ulysses all-to-all (heads <-> sequence) and Ulysses attention around any kernel.
- hybrid.py: `context_attention`, Ulysses inside and ring across (either optional), the one entry for attention.
- model.py: the HF wiring: the "mindspeed_cp" attention, `split_cp_batch` (a model batch -> this rank's share, with
  the loss scaling), the checks, and `apply_context_parallel` (parallelize's cp step).
- attached.py: `context_of(model)`, the ContextParallel a model was prepared with.
- blocks.py: one block's attention with its log-sum-exp and its backward, per device (CPU flash kernel, CUDA
  SDPA flash, NPU npu_fusion_attention / npu_fusion_attention_grad), chosen by the kernel registry.
"""

from ...lazy_exports import lazy_exports, public_names

#: each module of this package -> its public names, imported on first use
_MODULES: dict[str, tuple[str, ...]] = {
    "blocks": ("block_backward", "block_forward"),
    "hybrid": ("context_attention",),
    "model": (
        "CP_ATTENTION", "ContextParallel", "apply_context_parallel", "check_context_parallel", "context_parallel_from",
        "split_cp_batch", "valid_tokens",
    ),
    "attached": ("context_of",),
    "ring": ("local_attention", "ring_attention"),
    "split": (
        "gather_sequence", "padded_length", "segment_ids", "shard_indices", "shift_labels", "split_batch", "unshard",
    ),
    "ulysses": ("all_to_all", "check_ulysses_heads", "heads_to_seq", "seq_to_heads", "ulysses_attention"),
}

__all__ = public_names(_MODULES)
__getattr__, __dir__ = lazy_exports(__name__, _MODULES)
