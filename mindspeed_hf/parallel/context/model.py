"""Context parallelism for HF models: the attention HF calls, the batch split, and the checks before any work.

A model under `parallel.cp > 1` keeps HF's code paths; only its attention implementation changes, to
"mindspeed_cp" (registered with HF's AttentionInterface, and a mask function of the same name that builds no
mask): each attention call runs `context_attention` on this rank's slice over the cp group (ring across, Ulysses
inside, zigzag, GQA, packed documents, sliding window). The slice's facts travel as forward keyword arguments,
which HF hands to every attention call (and to activation checkpointing's recompute): global `position_ids`
(RoPE and the window) and `segment_ids` (packed documents, left padding; None when there are none).

A training step on a global batch (the same on every rank of a cp group)::

    local = split_cp_batch(batch, ctx)       # this rank's tokens, labels shifted globally
    loss = model(**local).loss               # HF's loss (or the fused one) on the slice
    loss.backward()                          # FSDP2 averages gradients over dp_shard x cp

The loss divides the slice's summed token losses by (global valid tokens / cp), so each rank's loss is cp times
its share: the mean over the cp group (what FSDP2's gradient average and Trainer's logged mean take) is the loss
of one process on the whole sequence, and so are the averaged gradients.

A vision-language model is split inside instead (multimodal.py): it gets the whole batch with this rank's labels,
and its language model takes its slice after the vision features are merged into the text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...ops.attention import register_attention
from .hybrid import context_attention
from .multimodal import SPLIT_MARK as _SPLIT_MARK
from .multimodal import language_model_of, share_vision, split_inside, vision_tower_of
from .split import IGNORE_INDEX, shift_labels, split_batch
from .ulysses import check_ulysses_heads

CP_ATTENTION = "mindspeed_cp"


@dataclass(frozen=True)
class ContextParallel:
    """One rank's view of its cp group: sizes, layout, and the ring / Ulysses process groups."""

    cp: int
    ulysses: int
    zigzag: bool
    rank: int  # in the cp group: ring rank * ulysses + Ulysses rank
    ring_group: dist.ProcessGroup | None
    ulysses_group: dist.ProcessGroup | None
    pad_token_id: int = 0
    inside: bool = False  # split inside the model (vision-language: after the vision features are merged)
    vision: bool = False  # parallel.cp_vision: the vision tower's frames shared over the cp group
    group: dist.ProcessGroup | None = None  # the whole cp group (ring x Ulysses)

    @property
    def ring(self) -> int:
        return self.cp // self.ulysses


def context_parallel_from(dims: Any, zigzag: bool = True, pad_token_id: int = 0,
                          vision: bool = False) -> ContextParallel:
    """The ContextParallel of this rank from built ParallelDims (`dims.build_mesh` called; mesh axes cp_ring x
    cp_ulysses)."""
    ring, ulysses, cp = dims.get_mesh("cp_ring"), dims.get_mesh("cp_ulysses"), dims.get_mesh("cp")
    return ContextParallel(dims.cp, dims.cp_ulysses, bool(zigzag), cp.get_local_rank(),
                           ring.get_group() if ring.size() > 1 else None,
                           ulysses.get_group() if ulysses.size() > 1 else None, int(pad_token_id or 0),
                           vision=bool(vision), group=cp.get_group())


# -------------------------------------------------------------------------------------------------- the batch


def _right_padded(mask: torch.Tensor) -> bool:
    """True when every row's attention mask is ones then zeros (causal tokens never see their padding)."""
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def valid_tokens(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """Tokens of a global [B, S] batch that predict a label after the causal shift (HF's loss denominator)."""
    return int((shift_labels(labels, ignore_index) != ignore_index).sum())


def split_cp_batch(batch: Mapping[str, Any], ctx: ContextParallel, num_items_in_batch: float | None = None,
                   ignore_index: int = IGNORE_INDEX) -> dict[str, Any]:
    """This rank's share of a global causal-LM batch (`input_ids` [B, S], optional `labels`, `position_ids`,
    `attention_mask`; other keys pass through), ready for `model(**local)`.

    The local batch holds `input_ids`, global `position_ids`, `segment_ids` (packed rows or left padding, else
    None), `use_cache=False`, and with labels `labels` = `shift_labels` (shifted globally, this rank's slice) and
    `num_items_in_batch` = (valid tokens of the global batch, or the one given) / cp (see the module docstring).
    """
    if batch.get("inputs_embeds") is not None or batch.get("input_ids") is None:
        raise ValueError("split_cp_batch: context parallelism needs `input_ids` [batch, seq] (inputs_embeds is not "
                         "split)")
    input_ids, labels, mask = batch["input_ids"], batch.get("labels"), batch.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise ValueError(f"split_cp_batch: attention_mask must be the 2-D padding mask [batch, seq], got "
                         f"{mask.dim()}-D (custom masks cannot be split)")
    padding = None if mask is None or _right_padded(mask) else mask
    parts = split_batch(input_ids, labels, _text_positions(batch.get("position_ids"), ctx), cp=ctx.cp, rank=ctx.rank,
                        zigzag=ctx.zigzag, ulysses=ctx.ulysses, pad_token_id=ctx.pad_token_id,
                        ignore_index=ignore_index, attention_mask=padding)
    skip = {"labels", "shift_labels", "num_items_in_batch"}
    if not ctx.inside:  # a vision-language model keeps them whole: its language model takes its slice
        skip |= {"input_ids", "position_ids", "attention_mask"}
    local = {k: v for k, v in batch.items() if k not in skip}
    if not ctx.inside:
        local.update(input_ids=parts["input_ids"], position_ids=parts["position_ids"])
    local.update(use_cache=False)
    local[_SPLIT_MARK] = parts["segment_ids"]
    if labels is not None:
        count = valid_tokens(labels, ignore_index) if num_items_in_batch is None else float(num_items_in_batch)
        local.update(labels=parts["shift_labels"], shift_labels=parts["shift_labels"],
                     num_items_in_batch=count / ctx.cp)
    return local


def _text_positions(positions: torch.Tensor | None, ctx: ContextParallel) -> torch.Tensor | None:
    """The [batch, seq] positions that tell packed documents apart: as given, or (a vision-language model) the
    text row of HF's [4, batch, seq] M-RoPE positions."""
    if positions is None or positions.dim() == 2 or not ctx.inside:
        return positions
    if positions.dim() == 3 and positions.shape[0] == 4:
        return positions[0]
    raise ValueError(f"split_cp_batch: position_ids of shape {list(positions.shape)} cannot be split; pass the "
                     "[batch, seq] text positions (FlatteningCollator does) or HF's [4, batch, seq] (text row first)")


# ---------------------------------------------------------------------------------------------- the attention


def cp_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         sliding_window: int | None = None, softcap: float | None = None,
                         **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF AttentionInterface function: this rank's q [B,Nq,S_local,D], k/v [B,Nkv,S_local,D] over the cp group ->
    ([B,S_local,Nq,Dv], None)."""
    ctx: ContextParallel | None = getattr(module, "_mindspeed_cp", None)
    if ctx is None:
        raise RuntimeError(f"attn_implementation={CP_ATTENTION!r} runs only in a model prepared by "
                           "parallelize() with parallel.cp > 1")
    if _SPLIT_MARK not in kwargs:
        raise ValueError(f"parallel.cp={ctx.cp}: the model got a batch that was not split across the cp group; "
                         "pass split_cp_batch(batch, ctx) to the model")
    if softcap is not None or kwargs.get("s_aux") is not None or (dropout and module.training):
        raise ValueError("parallel.cp: attention logit softcapping, attention sinks and attention dropout cannot "
                         "be split across the cp group")
    position_ids = kwargs.get("position_ids")
    window = sliding_window if sliding_window else None
    causal = kwargs.get("is_causal")
    causal = bool(causal if causal is not None else getattr(module, "is_causal", True))
    out = context_attention(query, key, value, ring_group=ctx.ring_group, ulysses_group=ctx.ulysses_group,
                            segment_ids=kwargs[_SPLIT_MARK], position_ids=position_ids if window else None,
                            causal=causal, scale=scaling, zigzag=ctx.zigzag, sliding_window=window)
    return out.transpose(1, 2).contiguous(), None


def cp_mask(*args: Any, **kwargs: Any) -> None:
    """HF AttentionMaskInterface function: no mask (cp_attention_forward keeps causality, documents and the
    window itself, from the split batch)."""
    return None


def register_cp_attention() -> None:
    """Register cp_attention_forward and cp_mask with HF under "mindspeed_cp" (idempotent; disable() removes it)."""
    register_attention(CP_ATTENTION, cp_attention_forward, cp_mask,
                       "context parallelism (ring / Ulysses) over our attention kernel")


# -------------------------------------------------------------------------------------------------- the model


def check_context_parallel(hf_model: nn.Module, ulysses: int, vision: bool = False) -> None:
    """One-line errors, before any work, for a model whose attention cannot be split over the cp group."""
    config = hf_model.config
    if getattr(config, "vision_config", None) is not None and language_model_of(hf_model) is None:
        raise ValueError(f"parallel.cp: {config.model_type} has no `model.language_model` to split the sequence in "
                         "after the vision (and audio) features are merged (the Omni thinkers have one from "
                         "transformers 5.23 on); valid choices: parallel.cp=1 (dp_shard, ep and tp work), or a "
                         "text-only model")
    if vision and vision_tower_of(hf_model) is None:
        raise ValueError(f"parallel.cp_vision=true: {config.model_type} has no Qwen-VL vision tower "
                         "(`model.visual`) to share over the cp ranks; valid choices: parallel.cp_vision=false")
    text = getattr(config, "get_text_config", lambda: config)()
    if "linear_attention" in (getattr(text, "layer_types", None) or ()):
        raise ValueError(f"parallel.cp: {text.model_type} has Gated DeltaNet linear-attention layers, whose recurrent "
                         "state runs through the whole sequence and is not yet passed from cp rank to cp rank; valid "
                         "choices: parallel.cp=1 (dp_shard and ep work)")
    heads = getattr(text, "num_attention_heads", None)
    if heads is None:
        raise ValueError(f"parallel.cp: model type {text.model_type!r} has no num_attention_heads; context "
                         "parallelism supports decoder-only causal LMs")
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    check_ulysses_heads(heads, kv_heads, ulysses)
    for name in ("attn_logit_softcapping",):
        if getattr(text, name, None):
            raise ValueError(f"parallel.cp: {text.model_type} uses {name}={getattr(text, name)}, which context "
                             "parallel attention cannot split; valid choices: parallel.cp=1")
    if float(getattr(text, "attention_dropout", 0.0) or 0.0) > 0:
        raise ValueError(f"parallel.cp: attention_dropout={text.attention_dropout} must be 0 under context "
                         "parallelism")


def apply_context_parallel(hf_model: nn.Module, ctx: ContextParallel) -> nn.Module:
    """Make `hf_model`'s attention run over the cp group (checked first): every attention module gets `ctx`,
    the model's attn_implementation becomes "mindspeed_cp" - for a vision-language model only its text config's,
    the sequence then split inside the model (multimodal.split_inside) and, with `ctx.vision`, the tower's
    frames shared over the cp group (multimodal.share_vision)."""
    check_context_parallel(hf_model, ctx.ulysses, ctx.vision)
    register_cp_attention()
    for module in hf_model.modules():
        if hasattr(module, "is_causal") or type(module).__name__.endswith("Attention"):
            module._mindspeed_cp = ctx
    if getattr(hf_model.config, "vision_config", None) is not None:
        # The vision tower keeps its attention and runs on every image; the text layers run on the slice.
        ctx = dataclasses.replace(ctx, inside=True)
        split_inside(hf_model, ctx.cp, ctx.rank, ctx.zigzag, ctx.ulysses)
        if ctx.vision:
            share_vision(hf_model, ctx.group)
        hf_model.set_attn_implementation({"text_config": CP_ATTENTION})
    else:
        hf_model.set_attn_implementation(CP_ATTENTION)
    hf_model._mindspeed_cp = ctx
    return hf_model
