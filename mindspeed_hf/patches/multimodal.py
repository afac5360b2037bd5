"""Vision-language models: the vision tower's attention on one varlen call over all images, the vision rope, the
fused chunked loss on XForConditionalGeneration heads, and the split of report() counts into vision and text.

- Vision attention (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE): the class forward is replaced, so HF's
  "flash"-name test for its varlen branch never matters: the model keeps an attention name registered with a mask
  function ("mindspeed"), the text attention keeps its padding mask, and the vision attention sends the packed
  patches of every image (or every Qwen2.5-VL window) to ops.vision_attention in one call.
- Packed rows (mindspeed_hf.data.FlatteningCollator): every document gets its own M-RoPE positions from HF's
  get_rope_index, and HF's packed (block-diagonal) mask (packed_positions.py).
- Fused loss: HF's head forward runs as is (vision tower, deepstack, mRoPE positions and rope_deltas, MoE router
  logits, output types: all the release's own) with `labels=None` while `lm_head` passes the hidden states through;
  the loss is then the chunked fused linear cross-entropy on the real lm_head, with `shift_labels`,
  `num_items_in_batch` and `ignore_index` honoured (HF's Qwen3-VL head drops them), plus the MoE aux loss as HF adds
  it. No [tokens, vocab] logits exist.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..ops import rotary
from ..ops.attention import ATTENTION_NAME
from ..ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from ..ops.vision_attention import vision_attention
from ..releases import compat
from . import packed_positions, scope
from .causal_lm import SkippedLogits, logits_plan, rebuilt, tuple_requested
from .forwards import tag
from .lazy_logits import deferred_logits
from .patching import set_once, switch

LOSS_ONLY_KWARGS = ("shift_labels", "num_items_in_batch", "ignore_index")


def _modeling_of(module: nn.Module):
    return sys.modules[type(module).__module__]


def vision_attention_forward(original: Callable) -> Callable:
    """XVisionAttention.forward on the packed patches: qkv, the module's (patched) vision rope, one varlen
    attention call over all segments of `cu_seqlens`, proj. Signature-agnostic (4.57 passes `rotary_pos_emb`,
    5.x `max_seqlen`): arguments are bound against HF's own forward."""
    signature = inspect.signature(original)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        bound = signature.bind(self, *args, **kwargs).arguments
        hidden, cu_seqlens = bound["hidden_states"], bound["cu_seqlens"]
        position_embeddings = bound.get("position_embeddings")
        if position_embeddings is None or compat.attn_implementation(self.config) != ATTENTION_NAME:
            # an explicit attention request ("eager", "flash_attention_2", ...) or cos/sin made inside: HF's code
            return original(self, *args, **kwargs)
        seq = hidden.shape[0]
        if hasattr(self, "qkv"):  # one packed projection (Qwen2-VL .. Qwen3-VL)
            q, k, v = self.qkv(hidden).reshape(seq, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        else:  # three (Qwen2.5-Omni's tower)
            q, k, v = (getattr(self, name)(hidden).reshape(seq, self.num_heads, -1) for name in ("q", "k", "v"))
        q, k = _modeling_of(self).apply_rotary_pos_emb_vision(q, k, *position_embeddings)
        dropout = self.attention_dropout if self.training else 0.0
        out = vision_attention(q, k, v, cu_seqlens, self.scaling, dropout)
        return self.proj(out.reshape(seq, -1))

    return tag("attention", forward)


def audio_attention_forward(original: Callable) -> Callable:
    """XAudioAttention.forward (Whisper-style encoder of the Omni models) on the packed chunks of every clip: HF cuts
    each clip into windows and hands the layer all of them with their `cu_seqlens` (its own boundaries); the
    attention is one varlen call over all of them (HF's non-flash path: one call per window). An explicit
    attention request, or attention weights asked for, keep HF's code."""
    signature = inspect.signature(original)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        bound = signature.bind(self, *args, **kwargs).arguments
        hidden, cu_seqlens = bound["hidden_states"], bound.get("cu_seqlens")
        if (cu_seqlens is None or compat.attn_implementation(self.config) != ATTENTION_NAME
                or bound.get("kwargs", {}).get("output_attentions")):
            return original(self, *args, **kwargs)
        seq = hidden.shape[0]
        q, k, v = (getattr(self, f"{name}_proj")(hidden).reshape(seq, self.num_heads, -1) for name in "qkv")
        dropout = self.attention_dropout if self.training else 0.0
        out = vision_attention(q, k, v, cu_seqlens, self.scaling, dropout)
        return self.out_proj(out.reshape(seq, -1))

    return tag("attention", forward)


class _PassThrough(nn.Module):
    """Stands in for lm_head while HF's head forward runs: the 'logits' it returns are the hidden states."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states


@contextlib.contextmanager
def _hidden_states_out(model: nn.Module) -> Iterator[nn.Module]:
    """Swap `model.lm_head` for a pass-through; yields the real head."""
    head = model._modules["lm_head"]
    model._modules["lm_head"] = _PassThrough()
    try:
        yield head
    finally:
        model._modules["lm_head"] = head


def _aux_loss_coef(model: nn.Module) -> float:
    config = model.config
    return float(getattr(getattr(config, "text_config", config), "router_aux_loss_coef", 0.0))


def vlm_head_forward(original: Callable) -> Callable:
    """XForConditionalGeneration.forward with the fused chunked loss while training with labels (same rule as the
    causal-LM heads, kernels.skip_logits); HF's forward otherwise. Accepts `skip_logits` like causal_lm_forward.
    HF's tuple comes back where the caller asks for one (causal_lm.tuple_requested: named, through **kwargs, or
    config.return_dict)."""
    signature = inspect.signature(original)

    def forward(self: nn.Module, *args: Any, skip_logits: bool | None = None, **kwargs: Any):
        bound = signature.bind(self, *args, **kwargs)
        labels = bound.arguments.get("labels")
        mode = scope.current().kernels.skip_logits
        plan = "full" if "lm_head" not in self._modules else logits_plan(self, self.lm_head, labels, skip_logits, mode)
        if plan == "full":
            return original(self, *args, **kwargs)
        as_tuple = tuple_requested(signature, bound.arguments, self.config)
        if as_tuple and "return_dict" in signature.parameters:
            # transformers 4.57's heads take return_dict by name and build their tuple by hand (the inner model's
            # tuple after the logits), not ModelOutput.to_tuple(): HF's forward gives exactly that
            return original(self, *args, **kwargs)
        extra = bound.arguments.get("kwargs", {})
        loss_kwargs = {name: extra.pop(name) for name in LOSS_ONLY_KWARGS if name in extra}
        bound.arguments["labels"] = None
        with _hidden_states_out(self) as lm_head:
            outputs = original(*bound.args, **bound.kwargs)
        loss = fused_linear_cross_entropy(
            outputs.logits, lm_head, labels,
            shift_labels=loss_kwargs.get("shift_labels"),
            ignore_index=loss_kwargs.get("ignore_index", -100),
            num_items_in_batch=loss_kwargs.get("num_items_in_batch"),
            chunk_size=scope.current().kernels.loss_chunk_size,
        )
        aux_loss = getattr(outputs, "aux_loss", None)
        if aux_loss is not None:  # MoE heads add the router's load-balancing loss when they return it
            loss = loss + _aux_loss_coef(self) * aux_loss.to(loss.device)
        logits = SkippedLogits(mode) if plan == "skip" else deferred_logits(lm_head, outputs.logits)
        result = rebuilt(outputs, loss=loss, logits=logits)
        return result.to_tuple() if as_tuple else result

    return forward


def vision_modules(hf_model: nn.Module, vision_classes: tuple[type, ...]) -> set[int]:
    """ids of every module inside the model's vision tower(s) (instances of `vision_classes`)."""
    found: set[int] = set()
    for module in hf_model.modules():
        if isinstance(module, vision_classes) and id(module) not in found:
            found.update(id(m) for m in module.modules())
    return found


def vision_rope_forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The vision towers' module-level `apply_rotary_pos_emb_vision` (fp32, as HF)."""
    return rotary.apply_rotary_pos_emb_vision(q, k, cos, sin)


tag("rope", vision_rope_forward)

VISION_OPS = ("rms_norm", "rope", "swiglu", "attention")
_SECTIONED_ROPE = "apply_multimodal_rotary_pos_emb"  # transformers 4.57's Qwen2-VL / Qwen2.5-VL text attention


def sectioned_mrope_forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            mrope_section: list[int], unsqueeze_dim: int = 1):
    """4.57's `apply_multimodal_rotary_pos_emb`: cos/sin [3, B, S, D] (temporal, height, width rows) folded by
    `mrope_section` exactly as HF does (contiguous sections), then the fused rope applies."""
    cos, sin = rotary.multimodal_rope_tables(cos, sin, mrope_section)
    return rotary.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


tag("rope", sectioned_mrope_forward)


def patch(family, module) -> None:
    """The multimodal site (sites.SITES): patch a family's vision attention classes, vision rope and VLM heads (names
    the installed release lacks are skipped), and packed rows' per-document positions."""
    for name in family.vision_attention:
        cls = getattr(module, name, None)
        # cos/sin handed in (Qwen2.5-Omni before transformers 5.20 rotates inside the layer: left as it is)
        if cls is not None and "position_embeddings" in inspect.signature(cls.forward).parameters:
            switch(cls, "forward", "attention", vision_attention_forward(cls.forward))
    for name in family.audio_attention:
        cls = getattr(module, name, None)
        # transformers < 5.20's takes an attention mask and returns a tuple: left as it is
        if cls is not None and "attention_mask" not in inspect.signature(cls.forward).parameters:
            switch(cls, "forward", "attention", audio_attention_forward(cls.forward))
    rope = getattr(module, "apply_rotary_pos_emb_vision", None)
    # (q, k, cos, sin); Qwen2.5-Omni before transformers 5.20 rotates one tensor by its freqs: left as it is
    if family.vision_rope and rope is not None and len(inspect.signature(rope).parameters) >= 4:
        switch(module, "apply_rotary_pos_emb_vision", "rope", vision_rope_forward)
    if family.vlm_heads and family.rope and hasattr(module, _SECTIONED_ROPE):
        switch(module, _SECTIONED_ROPE, "rope", sectioned_mrope_forward)
    for name in family.vlm_heads:
        cls = getattr(module, name, None)
        if cls is not None:  # an Omni thinker's packed rows get their positions here, whether the loss is ours or not
            base = packed_positions.packed_positions_forward(cls.forward) if family.audio_model else cls.forward
            switch(cls, "forward", "fused_linear_cross_entropy", vlm_head_forward(base), base)
    packed_positions.patch_family(family, module, set_once)


def _rope_patched(family, module) -> bool:
    names = ("apply_rotary_pos_emb", _SECTIONED_ROPE) if family.vlm_heads else ("apply_rotary_pos_emb",)
    return any(getattr(getattr(module, name, None), "_mindspeed_op", None) == "rope" for name in names)


def text_attention_sites(family, module, hf_model: nn.Module, families: dict, modeling: Callable) -> dict[type, bool]:
    """{text attention class: whether its module's apply_rotary_pos_emb is ours}: the family's own, and for
    LLaVA / InternVL the language model's family (config.text_config.model_type)."""
    sites = {}
    if family.attention and hasattr(module, family.attention):
        sites[getattr(module, family.attention)] = _rope_patched(family, module)
    text_config = getattr(hf_model.config, "text_config", None)
    nested = families.get(getattr(text_config, "model_type", None)) if family.text_from_config else None
    nested_module = modeling(nested) if nested is not None else None
    if nested_module is not None and hasattr(nested_module, nested.attention):
        sites[getattr(nested_module, nested.attention)] = _rope_patched(nested, nested_module)
    return sites


def tower_modules(module, hf_model: nn.Module, tower: str) -> set[int]:
    """ids of every module inside the model's towers of class `tower` (a name in `module`; none when empty)."""
    cls = getattr(module, tower, None) if tower else None
    return vision_modules(hf_model, (cls,)) if cls is not None else set()


def vision_sites(family, module, hf_model: nn.Module) -> tuple[set[int], tuple[type, ...], bool]:
    """(ids of the vision tower's modules, its patched attention classes, whether the vision rope is ours)."""
    ids = tower_modules(module, hf_model, family.vision_model)
    attention = tuple(getattr(module, n) for n in family.vision_attention if hasattr(module, n))
    rope = getattr(getattr(module, "apply_rotary_pos_emb_vision", None), "_mindspeed_op", None) == "rope"
    return ids, attention, rope
