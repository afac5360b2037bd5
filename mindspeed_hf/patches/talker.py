"""The Omni talkers' fine-tuning loss: codec labels scored once, by the fused chunked cross-entropy.

- Talker heads (`Qwen2_5OmniTalkerForConditionalGeneration`, `Qwen3OmniMoeTalkerForConditionalGeneration`): with
  `labels` (the codec ids at the input positions, HF's causal-LM convention: shifted once inside the loss, -100
  ignored; Qwen3-Omni: codebook 0) the loss is `ops.fused_linear_cross_entropy` on the real `codec_head`. HF's own
  forward runs as is (positions, cache, MoE router logits, output types: the release's) with `codec_head` replaced
  by a module that hands back the hidden states it is given, so no [tokens, codec vocabulary] logits exist; the
  logits are then made on first read, or skipped, by the same rule as the causal-LM heads (kernels.skip_logits,
  causal_lm.logits_plan), in the dtype HF gives them (Qwen2.5-Omni: fp32). Qwen2.5-Omni's HF forward computes no
  loss at all (it takes no labels); Qwen3-Omni's adds the router's load-balancing loss, as here (its own labels
  path reads `config.vocab_size`, which Qwen3OmniMoeTalkerConfig lacks: an AttributeError on 4.57 .. 5.24).
- Qwen2.5-Omni's prefill: with an `attention_mask` and no `position_ids`, HF's forward treats the call as
  generate's first step: it takes positions from `get_rope_index` and adds the codec pad / bos embeddings IN PLACE
  to the last two positions of `inputs_embeds` (and stores `rope_deltas`). A training forward (labels given) takes
  the same positions from HF's `get_rope_index` and hands them in, so the caller's `inputs_embeds` are used as given
  (every position's codec embedding is the caller's to add, as generate's prompt is built) and never written to.
- Code predictor (`Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration`): HF's forward scores every
  position with ONE head (the last one the sequence length reaches), after shifting the labels. Here each head
  scores its own codebook: for `inputs_embeds` [N, L, H] = [talker state, codebook 0, .., codebook L-2 embeddings]
  and `labels` [N, L] = the frame's codes (codebook g in column g), the state at position p (p >= 1) goes through
  head p-1 and is scored on `labels[:, p]`, the codebook after the one at its input (one shift; column 0, the
  talker's codebook, is never a target). The loss is the mean over every scored code (or the sum over
  `num_items_in_batch`); `logits`, where read, are [N, L-1, V]: head j's at position j+1.
Without labels (generation) every forward is HF's.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from . import scope
from .causal_lm import SkippedLogits, logits_plan, rebuilt, tuple_requested
from .lazy_logits import deferred_logits
from .patching import switch

OP = "fused_linear_cross_entropy"
_LOSS_ONLY = ("shift_labels", "num_items_in_batch", "ignore_index")


class _Capture(nn.Module):
    """Stands in for a head while HF's forward runs: returns the hidden states and keeps them."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.seen = hidden_states
        return hidden_states


@contextlib.contextmanager
def _replaced(model: nn.Module, name: str, stand_in: nn.Module) -> Iterator[nn.Module]:
    """`model.<name>` is `stand_in` inside; yields the real module."""
    real = model._modules[name]
    model._modules[name] = stand_in
    try:
        yield real
    finally:
        model._modules[name] = real


class _Heads(nn.Module):
    """The code predictor's heads as one module: hidden [..., K, H] -> logits [..., K, V], head j on row j (a 2-D
    input: head 0 on every row)."""

    def __init__(self, heads: nn.ModuleList) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() == 2:
            return self.heads[0](hidden)
        return torch.stack([self.heads[j](hidden[..., j, :]) for j in range(hidden.shape[-2])], dim=-2)


def with_labels(original: Callable) -> inspect.Signature:
    """HF's forward signature plus keyword-only `labels` (where it has none) and `skip_logits`: what Trainer reads
    to keep the label column and find the label names."""
    signature = inspect.signature(original)
    params = list(signature.parameters.values())
    tail = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    head = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    names = {p.name for p in params}
    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
             for name in ("labels", "skip_logits") if name not in names]
    return signature.replace(parameters=[*head, *extra, *tail])


def _split(signature: inspect.Signature, self: nn.Module, args: tuple, kwargs: dict):
    """Bind a call against HF's signature: (bound arguments, labels, loss-only kwargs, whether a tuple was asked)."""
    kwargs = dict(kwargs)
    labels = kwargs.pop("labels", None) if "labels" not in signature.parameters else None
    loss_kwargs = {name: kwargs.pop(name) for name in _LOSS_ONLY if name in kwargs}
    bound = signature.bind(self, *args, **kwargs)
    arguments = bound.arguments
    if "labels" in signature.parameters:
        labels = arguments.pop("labels", None)
    return bound, labels, loss_kwargs, tuple_requested(signature, arguments, self.config)


def _aux_loss(model: nn.Module, outputs: Any, loss: torch.Tensor) -> torch.Tensor:
    """The MoE router's load-balancing loss added as HF adds it (where the forward returned one)."""
    aux = getattr(outputs, "aux_loss", None)
    if aux is None:
        return loss
    return loss + float(getattr(model, "router_aux_loss_coef", 0.0)) * aux.to(loss.device)


def _training_positions(self: nn.Module, arguments: dict) -> None:
    """Qwen2.5-Omni: positions from HF's get_rope_index for a forward with an attention mask and no positions, so
    HF's prefill branch (which writes codec embeddings into inputs_embeds) does not run."""
    if arguments.get("position_ids") is not None or arguments.get("attention_mask") is None:
        return
    if arguments.get("inputs_embeds") is None:
        raise ValueError("labels: the Qwen2.5-Omni talker trains on inputs_embeds (thinker states + codec "
                         "embeddings, one per position); input_ids with thinker_reply_part is its one-token "
                         "decoding step")
    positions, _ = self.get_rope_index(
        arguments.get("input_text_ids"), arguments.get("image_grid_thw"), arguments.get("video_grid_thw"),
        arguments["attention_mask"], arguments.get("use_audio_in_video"), arguments.get("audio_feature_lengths"),
        arguments.get("video_second_per_grid"))
    arguments["position_ids"] = positions


def talker_forward(original: Callable, fused: bool) -> Callable:
    """XTalkerForConditionalGeneration.forward with the codec labels' loss (module docstring). `fused`: the fused
    loss where logits_plan allows it; otherwise (the kernel switched off) HF's logits and HF's loss function."""
    signature = inspect.signature(original)
    prefill_writes = "input_text_ids" in signature.parameters  # Qwen2.5-Omni's prefill branch

    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, skip_logits: bool | None = None, **kwargs: Any) -> Any:
        bound, labels, loss_kwargs, as_tuple = _split(signature, self, args, kwargs)
        if labels is None:
            return original(self, *args, **kwargs)
        arguments = bound.arguments
        if prefill_writes:
            _training_positions(self, arguments)
        mode = scope.current().kernels.skip_logits
        plan = logits_plan(self, self.codec_head, labels, skip_logits, mode) if fused else "full"
        if plan == "full":
            outputs = original(*bound.args, **bound.kwargs)
            loss = self.loss_function(logits=outputs.logits, labels=labels, vocab_size=outputs.logits.shape[-1],
                                      **loss_kwargs)
            logits = outputs.logits
        else:
            with _replaced(self, "codec_head", capture := _Capture()) as head:
                outputs = original(*bound.args, **bound.kwargs)
            hidden = capture.seen
            loss = fused_linear_cross_entropy(
                hidden, head, labels, shift_labels=loss_kwargs.get("shift_labels"),
                ignore_index=loss_kwargs.get("ignore_index", -100),
                num_items_in_batch=loss_kwargs.get("num_items_in_batch"),
                chunk_size=scope.current().kernels.loss_chunk_size)
            dtype = outputs.logits.dtype  # HF's logits dtype (Qwen2.5-Omni casts them to fp32)
            logits = SkippedLogits(mode) if plan == "skip" else deferred_logits(head, hidden).to(dtype)
        result = rebuilt(outputs, loss=_aux_loss(self, outputs, loss), logits=logits)
        return result.to_tuple() if as_tuple else result

    forward.__signature__ = with_labels(original)
    forward._mindspeed_op = OP
    return forward


def code_predictor_forward(original: Callable, fused: bool) -> Callable:
    """The code predictor's forward with per-codebook heads while training with labels (module docstring)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, skip_logits: bool | None = None, **kwargs: Any) -> Any:
        bound, labels, loss_kwargs, as_tuple = _split(signature, self, args, kwargs)
        embeds = bound.arguments.get("inputs_embeds")
        if labels is None or embeds is None or embeds.shape[1] < 2:
            return original(self, *args, **kwargs)
        length = embeds.shape[1]
        if tuple(labels.shape) != tuple(embeds.shape[:2]):
            raise ValueError(f"labels: the code predictor takes one code per input position, shape "
                             f"{tuple(embeds.shape[:2])} (the frame's codebooks 0 .. {length - 1}); got "
                             f"{tuple(labels.shape)}")
        if length > len(self.lm_head) + 1:
            raise ValueError(f"inputs_embeds: the code predictor has {len(self.lm_head)} heads, so at most "
                             f"{len(self.lm_head) + 1} positions (talker state + codebooks 0 .. "
                             f"{len(self.lm_head) - 1}); got {length}")
        captures = nn.ModuleList(_Capture() for _ in self.lm_head)
        with _replaced(self, "lm_head", captures) as heads:  # HF's forward sends the states through one head
            outputs = original(*bound.args, **bound.kwargs)
        hidden = next(c.seen for c in captures if c.seen is not None)[:, 1:]
        targets = labels[:, 1:]
        stacked = _Heads(heads[:length - 1])
        mode = scope.current().kernels.skip_logits
        plan = logits_plan(self, stacked, labels, skip_logits, mode) if fused else "full"
        if plan == "full":
            logits = stacked(hidden)
            rest = {k: v for k, v in loss_kwargs.items() if k != "shift_labels"}
            loss = self.loss_function(logits=logits, labels=None, vocab_size=logits.shape[-1],
                                      shift_labels=targets.contiguous(), **rest)
        else:
            ignore = loss_kwargs.get("ignore_index", -100)
            divisor = loss_kwargs.get("num_items_in_batch")
            divisor = (targets != ignore).sum() if divisor is None else divisor
            loss = sum(fused_linear_cross_entropy(hidden[:, j], heads[j], None, shift_labels=targets[:, j],
                                                  ignore_index=ignore, num_items_in_batch=divisor,
                                                  chunk_size=scope.current().kernels.loss_chunk_size)
                       for j in range(length - 1))
            logits = SkippedLogits(mode) if plan == "skip" else deferred_logits(stacked, hidden)
        result = rebuilt(outputs, loss=loss, logits=logits)
        return result.to_tuple() if as_tuple else result

    forward._mindspeed_op = OP
    return forward


def patch(family, module) -> None:
    """The talker site (sites.SITES): patch a family's talker heads and code predictors (names the installed release
    lacks are skipped): the fused loss while the running config has it on, otherwise the same labels handling on
    HF's logits and loss."""
    for names, make in ((family.talker_heads, talker_forward), (family.code_predictors, code_predictor_forward)):
        for cls in (getattr(module, name) for name in names if hasattr(module, name)):
            original = cls.forward
            switch(cls, "forward", OP, make(original, fused=True), make(original, fused=False))
