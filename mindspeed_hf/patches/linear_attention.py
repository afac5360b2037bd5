"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5): the Gated DeltaNet layers on the linear_attention op.

- The chunked gated delta rule (the modeling module's `torch_chunk_gated_delta_rule`, which the layers call by
  name on transformers >= 5.20; earlier releases bind it when a layer is built) runs on the backend's kernel
  (ops/linear_attention.py).
- The gated RMSNorm after it (XRMSNormGated: norm, weight, then silu(gate) in fp32) runs its norm on the rms_norm
  kernel.
- Packed rows: HF isolates packed documents in its full-attention layers (the block-diagonal mask found from the
  position ids) but its linear layers carry the recurrent state and the conv window across the documents
  (transformers 5.24, measured: a packed row's loss differs from the same documents as separate rows by ~1e-4 to
  6e-4 on tiny models). Here the text model's forward finds the documents once (HF's own packing rule on the text
  position ids; packed rows get no cache, as everywhere in mindspeed_hf) and every linear layer runs HF's forward on
  the documents laid out as right-padded rows with their 2-D mask (documents of similar length in one call, so that
  padding stays under a quarter of each call: ops/varlen.length_groups), so each document starts from a zero state
  and a zero conv window exactly as when it is its own row; the outputs go back into the packed row. The reference for a
  packed batch is therefore the documents as separate rows, not HF's packed forward.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import masking_utils

from ..ops import varlen
from ..ops.linear_attention import chunk_gated_delta_rule
from ..ops.rms_norm import rms_norm
from ..releases import compat
from .forwards import tag
from .packed_positions import bind, call_by_name, filled, without_cache
from .patching import switch

CHUNK_RULE = "torch_chunk_gated_delta_rule"
# The collator's flash-attention arguments describe the packed row, not the rows a linear layer runs on.
PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

# The packed documents of each text model forward that is running (innermost last).
_running: list[varlen.VarlenInfo] = []
# A linear layer's documents of its last forward, for its recompute in backward (the text model's forward is over).
_DOCUMENTS = "_mindspeed_documents"


def _packed_documents(arguments: dict[str, Any]) -> varlen.VarlenInfo | None:
    """The documents of a packed batch (text position ids restarting, no attention mask, no filled cache) over the
    flattened [batch * seq] tokens; None for anything else."""
    positions = arguments.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.dim() == 3 and positions.shape[0] == 4:
        positions = positions[0]  # Qwen3.5: the text row first, then the three M-RoPE rows
    inputs = arguments.get("input_ids")
    inputs = arguments.get("inputs_embeds") if inputs is None else inputs
    if (not isinstance(positions, torch.Tensor) or positions.dim() != 2 or inputs is None
            or arguments.get("attention_mask") is not None
            or filled(arguments.get("cache", arguments.get("past_key_values")))):
        return None
    ids = masking_utils.find_packed_sequence_indices(positions.expand(inputs.shape[0], -1))
    return None if ids is None else varlen.varlen_info(ids, "sequence_ids")


@contextlib.contextmanager
def packed_documents(documents: varlen.VarlenInfo) -> Iterator[None]:
    """While it is open, the linear layers run the packed batch's `documents` apart (what the text model's forward
    opens for a packed batch; a benchmark of one layer opens it itself)."""
    _running.append(documents)
    try:
        yield
    finally:
        _running.pop()


def text_model_forward(original: Callable) -> Callable:
    """XModel / XTextModel.forward: a packed batch runs without a cache, its documents known to the linear layers
    while it runs; anything else is HF's forward as is."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        bound, arguments = bind(signature, self, *args, **kwargs)
        documents = _packed_documents(arguments)
        if documents is None:
            return original(self, *args, **kwargs)
        without_cache(signature, bound)
        with packed_documents(documents):
            return call_by_name(original, signature, bound)

    return forward


def gated_delta_net_forward(original: Callable) -> Callable:
    """XGatedDeltaNet.forward: inside a packed forward, HF's forward over the documents as right-padded rows, one
    call per group of documents of similar length (and so again when recompute reruns it in backward)."""
    signature = inspect.signature(original)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        if compat.current_autograd_node() is not None:  # recomputed in backward: the documents its forward had
            documents = vars(self).get(_DOCUMENTS)
        else:
            documents = self.__dict__[_DOCUMENTS] = _running[-1] if _running else None
        if documents is None:  # not a packed batch: HF's forward, nothing bound
            return original(self, *args, **kwargs)
        bound, arguments = bind(signature, self, *args, **kwargs)
        hidden = arguments["hidden_states"]
        if documents.total != hidden.shape[0] * hidden.shape[1]:
            return original(self, *args, **kwargs)
        for name in PACKED_KWARGS:
            bound.arguments.get("kwargs", {}).pop(name, None)
        layout = varlen.document_layout(documents, hidden.device)
        flat, outputs = hidden.reshape(-1, hidden.shape[-1]), []
        for group in layout.groups:  # documents of similar length together: little padding, few calls
            bound.arguments["hidden_states"] = group.to_rows(flat)
            bound.arguments["attention_mask"] = group.mask
            outputs.append(call_by_name(original, signature, bound))
        return layout.join(outputs, hidden.shape[0])

    return tag("linear_attention", forward)


def chunk_rule_function(original: Callable) -> Callable:
    """The module's torch_chunk_gated_delta_rule -> the linear_attention op (HF's function is its torch kernel)."""

    @functools.wraps(original)
    def torch_chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, **options: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        return chunk_gated_delta_rule(original, query, key, value, g, beta, **options)

    return tag("linear_attention", torch_chunk_gated_delta_rule)


def gated_rms_norm_forward(original: Callable) -> Callable:
    """XRMSNormGated.forward: the norm (weight times the normalised input in its dtype, as Llama's) on the rms_norm
    kernel, then HF's silu(gate) product in fp32; another activation keeps HF's forward."""

    def forward(self: nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if gate is None or getattr(self, "activation", "silu") not in ("silu", "swish"):
            return original(self, hidden_states, gate)
        normed = rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return (normed * F.silu(gate.float())).to(hidden_states.dtype)

    return tag("rms_norm", forward)


def patch(family, module) -> None:
    """The linear_attention site (sites.SITES): patch a hybrid family's linear-attention sites."""
    if not family.linear_attention:
        return
    for name in family.text_models:
        if hasattr(module, name):
            cls = getattr(module, name)
            # switched with linear_attention, not a kernel site
            switch(cls, "forward", "linear_attention", text_model_forward(cls.forward), reported_as="packed_documents")
    layer = getattr(module, family.linear_attention, None)
    if layer is not None:
        switch(layer, "forward", "linear_attention", gated_delta_net_forward(layer.forward))
    if hasattr(module, CHUNK_RULE):
        switch(module, CHUNK_RULE, "linear_attention", chunk_rule_function(getattr(module, CHUNK_RULE)))
    norm = getattr(module, family.gated_rms_norm, None) if family.gated_rms_norm else None
    if norm is not None:
        switch(norm, "forward", "rms_norm", gated_rms_norm_forward(norm.forward))


def settle(model: nn.Module, family, module) -> int:
    """Layers of `model` built before enable() on transformers < 5.20 hold HF's own chunked rule, bound when the layer
    was built (5.20+ call it by name): point them at the module's switched rule, so the kernel report() names is the
    one that runs. A rule HF bound from flash-linear-attention is left alone. Returns the layers rebound."""
    layer_cls, current = getattr(module, family.linear_attention, None), getattr(module, CHUNK_RULE, None)
    hf_rule = getattr(current, "__wrapped__", None)  # scope.switch keeps HF's function there
    if layer_cls is None or hf_rule is None:
        return 0
    rebound = 0
    for layer in model.modules():
        if isinstance(layer, layer_cls) and vars(layer).get("chunk_gated_delta_rule") is hf_rule:
            layer.chunk_gated_delta_rule = current
            rebound += 1
    return rebound


def restore(model: nn.Module) -> int:
    """What ``disable()`` does for `model`: every layer holding our switched chunked rule as its own attribute (one
    ``settle`` rebound, or one built while enabled on transformers < 5.20) gets HF's function back. Returns the
    layers restored."""
    restored = 0
    for layer in model.modules():
        rule = vars(layer).get("chunk_gated_delta_rule")
        if getattr(rule, "_mindspeed_op", None) is not None and hasattr(rule, "__wrapped__"):
            layer.chunk_gated_delta_rule = rule.__wrapped__
            restored += 1
    return restored
