"""Auxiliary-loss-free expert balancing (`moe: {balance: aux_free, bias_update_rate: r}`), the scheme of
DeepSeek-V3: every MoE layer's router picks its top-k experts by score + a per-expert bias, the routing weights stay
the unbiased scores, and after each optimizer step every bias moves by r towards the mean load:
`bias_e += r * sign(mean load - load_e)` (loads counted over the step's micro-batches and summed over every rank, so
every rank moves its replica of the bias alike). No loss term and no gradient: the bias only steers the choice.

Where the bias lives:
- routers that already choose by a score-correction bias (DeepSeek-V3, GLM-4-MoE: `e_score_correction_bias`;
  ERNIE 4.5: `moe_statics.e_score_correction_bias`) get that very tensor updated, so it is saved with the model
  as HF's own weights;
- softmax top-k routers (Qwen2/3-MoE, Qwen3-Next, Qwen3.5-MoE, Qwen3-VL-MoE, Mixtral, OLMoE) get a buffer
  `expert_bias` and a forward hook that re-chooses the top-k from HF's router logits: softmax in fp32, top-k of
  probabilities + bias, the weights gathered from the probabilities, normalised where the router normalises (its
  `norm_topk_prob`; Mixtral and Qwen3-VL-MoE always do), in the dtype HF's router returns. The buffer is in the
  model's state dict (Trainer checkpoints and resumes it); a plain-HF model loading those weights has no place for it
  and routes without it.
Any other router (GPT-OSS's) is refused in one line. `moe.balance: none` (the default) attaches nothing.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..patches.experts import find_fused_experts
from .load import ExpertLoad

__all__ = ["AuxFreeBalance"]

BIAS = "expert_bias"
logger = logging.getLogger("mindspeed_hf")


def _native_bias(router: nn.Module) -> torch.Tensor | None:
    """The router's own score-correction bias, the one its forward already adds before the top-k."""
    for owner in (router, getattr(router, "moe_statics", None)):
        bias = getattr(owner, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            return bias
    return None


def _softmax_router(router: nn.Module | None) -> bool:
    """A router that returns (logits, top-k weights, top-k indices) of a softmax over `weight`'s experts."""
    return (router is not None and isinstance(getattr(router, "top_k", None), int)
            and isinstance(getattr(router, "weight", None), torch.Tensor) and router.weight.dim() == 2)


def _biased_choice(router: nn.Module, args: tuple, output: tuple) -> tuple:
    """Forward hook: the top-k re-chosen with the bias, HF's outputs' layout and dtypes kept."""
    logits, scores, _ = output
    probs = F.softmax(logits.float(), dim=-1)
    chosen = torch.topk(probs + getattr(router, BIAS), router.top_k, dim=-1).indices
    weights = probs.gather(-1, chosen)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(scores.dtype), chosen


class AuxFreeBalance:
    """The per-expert biases of every MoE layer of one model and the load they are updated from."""

    def __init__(self, model: nn.Module, rate: float) -> None:
        self.rate = rate
        self.biases: list[torch.Tensor] = []
        self._handles = []
        for name, _ in find_fused_experts(model):
            block = model.get_submodule(name.rpartition(".")[0])
            router = getattr(block, "gate", None)
            bias = None if router is None else _native_bias(router)
            if bias is None:
                if not _softmax_router(router):
                    raise ValueError(f"moe.balance=aux_free: {name} has no softmax top-k router (`gate`) or "
                                     f"score-correction bias to steer ({type(block).__name__}); valid choices: "
                                     "moe.balance=none")
                if not hasattr(router, BIAS):
                    router.register_buffer(BIAS, torch.zeros(router.weight.shape[0], dtype=torch.float32,
                                                             device=router.weight.device))
                bias = getattr(router, BIAS)
                self._handles.append(router.register_forward_hook(_biased_choice))
            self.biases.append(bias)
        self.load = ExpertLoad(model)

    @classmethod
    def attach(cls, model: nn.Module, config: Any) -> AuxFreeBalance | None:
        """The balance `config.moe` asks for on `model`; None when off or the model has no fused experts."""
        if config.moe.balance != "aux_free":
            return None
        balance = cls(model, config.moe.bias_update_rate)
        if not balance.biases:
            balance.remove()
            logger.warning("mindspeed_hf: moe.balance=aux_free does not apply to %s: it has no fused MoE experts "
                           "(a dense model, or transformers < 5); it trains unbalanced as before",
                           type(model).__name__)
            return None
        return balance

    def step(self) -> None:
        """After an optimizer step: every bias moves `rate` towards its layer's mean load (collective under
        torch.distributed: every rank calls it at the same step)."""
        counts = self.load.counts()
        if counts is None:
            return
        with torch.no_grad():
            for bias, load in zip(self.biases, counts):
                bias.add_((self.rate * torch.sign(load.mean() - load)).to(bias).reshape(bias.shape))

    def remove(self) -> None:
        """Detach the hooks (the biases stay where they are)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.load.remove()
