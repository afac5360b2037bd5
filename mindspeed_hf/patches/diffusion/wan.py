"""Wan's attention processor call with its video rope on the rope kernel.

Wan applies its 3-D rope with a function nested inside `WanAttnProcessor.__call__` (pairs (x[2i], x[2i+1]) rotated
by the table's frequencies: the interleave layout, its table the time / height / width frequencies side by side),
so no module attribute reaches it: the whole call is replaced. It does what diffusers' call does, step for step,
through the module's own helpers (`_get_qkv_projections`, `_get_added_kv_projections`: fused projections and PEFT
adapters keep working), the attention module's norms and output layers, and the module's `dispatch_attention_fn`
(so attention follows the same rules as every other site). It is installed only where the installed call is the
one it was written against (diffusers 0.42: the digest of its source); any other keeps diffusers' call, with
attention still ours through the dispatcher site.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ...ops.dit_rope import dit_rope
from ...releases.seams import source_of

logger = logging.getLogger("mindspeed_hf")

#: sha256 (first 16 hex digits) of the source of WanAttnProcessor.__call__ this replacement reproduces.
KNOWN_CALLS = frozenset({"13c09feedcfe814a"})
#: Wan's image-to-video processors take the image tokens as the first ones of encoder_hidden_states, all but the
#: text encoder's 512 (diffusers hard-codes the same number).
TEXT_TOKENS = 512


def digest(function: Callable) -> str:
    try:
        return hashlib.sha256(source_of(function).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return ""


def processor_call(module: ModuleType, original: Callable) -> Callable | None:
    """Our WanAttnProcessor.__call__, or None when the installed one is not the call it reproduces."""
    if digest(original) not in KNOWN_CALLS:
        logger.info("mindspeed_hf: this diffusers' WanAttnProcessor is not the one the rope kernel was checked "
                    "against; Wan's rope runs diffusers' code (attention is still fused)")
        return None

    def __call__(self: Any, attn: torch.nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        image_states = None
        if attn.add_k_proj is not None:  # image-to-video: image tokens first, the text's last
            split = encoder_hidden_states.shape[1] - TEXT_TOKENS
            image_states, encoder_hidden_states = encoder_hidden_states[:, :split], encoder_hidden_states[:, split:]
        query, key, value = module._get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)  # across all heads
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None:
            cos, sin = rotary_emb
            query, key = dit_rope(query, cos, sin, "interleave"), dit_rope(key, cos, sin, "interleave")
        attend = module.dispatch_attention_fn
        from_image = None
        if image_states is not None:
            key_img, value_img = module._get_added_kv_projections(attn, image_states)
            key_img = attn.norm_added_k(key_img)
            key_img, value_img = (t.unflatten(2, (attn.heads, -1)) for t in (key_img, value_img))
            from_image = attend(query, key_img, value_img, attn_mask=None, dropout_p=0.0, is_causal=False,
                                backend=self._attention_backend, parallel_config=None).flatten(2, 3).type_as(query)
        out = attend(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                     backend=self._attention_backend,
                     parallel_config=self._parallel_config if encoder_hidden_states is None else None)
        out = out.flatten(2, 3).type_as(query)
        if from_image is not None:
            out = out + from_image
        return attn.to_out[1](attn.to_out[0](out))

    return __call__
