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

from ...lazy_exports import lazy_exports

#: public name -> the module of this package that defines it (imported on first use)
_EXPORTS: dict[str, str] = {
    "block_backward": "blocks",
    "block_forward": "blocks",
    "context_attention": "hybrid",
    "CP_ATTENTION": "model",
    "ContextParallel": "model",
    "apply_context_parallel": "model",
    "check_context_parallel": "model",
    "context_parallel_from": "model",
    "split_cp_batch": "model",
    "valid_tokens": "model",
    "context_of": "attached",
    "local_attention": "ring",
    "ring_attention": "ring",
    "gather_sequence": "split",
    "padded_length": "split",
    "segment_ids": "split",
    "shard_indices": "split",
    "shift_labels": "split",
    "split_batch": "split",
    "unshard": "split",
    "all_to_all": "ulysses",
    "check_ulysses_heads": "ulysses",
    "heads_to_seq": "ulysses",
    "seq_to_heads": "ulysses",
    "ulysses_attention": "ulysses",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
