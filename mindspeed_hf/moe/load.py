"""MoE training people can watch: the load of every expert of every MoE layer, logged with the loss.

A forward pre-hook on each fused experts module (transformers >= 5: `gate_up_proj` / `down_proj` [E, ...], called
with the router's `top_k_index`) adds the tokens routed to each expert in that training forward to a device counter
(one scatter-add per layer, no host read). When Trainer logs the training loss, the counters of the interval are summed
over every rank (each sees its own tokens; ranks that see the same tokens, tensor parallelism, scale every count
alike, which leaves the ratios below unchanged), turned into `moe/*` keys and reset:

- `moe/layer_<i>/imbalance`: the busiest expert's tokens over the mean (1.0 = perfectly even);
- `moe/layer_<i>/zero_token_experts`: experts that got no token in the interval;
- `moe/imbalance` (mean over layers), `moe/imbalance_max`, `moe/zero_token_experts` (sum over layers);
- `moe/routed_per_layer`: (token, expert) assignments per layer in the interval (tokens x top-k, over all ranks).

With a `history` file (Trainer runs: OUTPUT_DIR/moe_load.jsonl, written by the main process) every interval's
tokens per expert per layer are appended as one JSON line, {"step": N, "tokens": [[...], ...]}: what
`mindspeed-hf moe OUTPUT_DIR [--plot FILE.png]` summarises and draws as a heatmap (cli/moe_report.py).

Under expert parallelism the hook sees the router's global expert ids before dispatch, so the counts are global too.
A forward traced by torch.compile is not counted (its graph runs no Python).
`moe.log_load: false` switches it off (no hooks at all).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..patches.experts import find_fused_experts
from ..releases import compat

__all__ = ["ExpertLoad"]

#: the config names of a MoE model's routed-expert count, by family
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


class ExpertLoad:
    """Tokens per expert per MoE layer of one model since the last `take()`."""

    #: the file of every interval's counts in a Trainer run's output directory
    HISTORY = "moe_load.jsonl"

    def __init__(self, model: nn.Module, history: str | None = None) -> None:
        self.history = history
        self.layers: list[torch.Tensor | None] = []
        self._handles = []
        for index, (_, module) in enumerate(find_fused_experts(model)):
            experts = _expert_count(module)
            self.layers.append(None)
            self._handles.append(module.register_forward_pre_hook(self._counter(index, experts), with_kwargs=True))

    @classmethod
    def attach(cls, model: nn.Module, history: str | None = None) -> ExpertLoad | None:
        """Counters on `model`'s fused experts modules (each interval appended to `history` when given); None when
        it has none (a dense model, transformers 4.57)."""
        load = cls(model, history)
        return load if load.layers else None

    def _counter(self, index: int, experts: int):
        def count(module: nn.Module, args: tuple, kwargs: dict) -> None:
            # not: eval, a recompute in backward, or a forward traced by torch.compile (its graph runs no Python)
            if not module.training or torch.compiler.is_compiling() or compat.current_autograd_node() is not None:
                return
            top_k_index = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            if top_k_index is None:
                return
            routed = top_k_index.reshape(-1).clamp(max=experts)  # HF's EP sentinel ids into an extra slot
            held = self.layers[index]
            if held is None:
                held = self.layers[index] = torch.zeros(experts + 1, dtype=torch.int64, device=routed.device)
            held.scatter_add_(0, routed, torch.ones_like(routed))  # no host read (a bincount sizes itself on it)

        return count

    def counts(self) -> torch.Tensor | None:
        """[counted layers, experts]: the tokens each expert got since the last read, summed over every rank
        (collective when torch.distributed is up); the counters then start again. None when no training forward
        ran since the last read."""
        counted = [c for c in self.layers if c is not None]
        if not counted:
            return None
        counts = torch.stack([c[:-1].float() for c in counted])  # the sentinel slot dropped
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        self.layers = [None] * len(self.layers)
        return counts

    def take(self, step: int | None = None) -> dict[str, float]:
        """The `moe/*` metrics of the interval (counts()), empty when no training forward ran since the last take;
        the counts appended to the history file, if any, as the interval ending at `step`."""
        counts = self.counts()
        if counts is None:
            return {}
        if self.history:
            os.makedirs(os.path.dirname(os.path.abspath(self.history)), exist_ok=True)
            with open(self.history, "a") as f:
                f.write(json.dumps({"step": step, "tokens": counts.long().tolist()}) + "\n")
        imbalance = (counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-12)).tolist()
        zero = (counts == 0).sum(dim=1).tolist()
        logs: dict[str, float] = {}
        for layer, (ratio, empty) in enumerate(zip(imbalance, zero)):
            logs[f"moe/layer_{layer}/imbalance"] = round(ratio, 4)
            logs[f"moe/layer_{layer}/zero_token_experts"] = int(empty)
        logs["moe/routed_per_layer"] = round(counts.sum().item() / len(counts), 1)
        logs["moe/imbalance"] = round(sum(imbalance) / len(imbalance), 4)
        logs["moe/imbalance_max"] = round(max(imbalance), 4)
        logs["moe/zero_token_experts"] = int(sum(zero))
        return logs

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _expert_count(module: nn.Module) -> int:
    """The routed-expert count of an experts module: its config's, else its (unsharded) weight's first dimension."""
    config = getattr(module, "config", None)
    for name in _EXPERT_COUNTS:
        value = getattr(module, name, None) or getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return int(module.gate_up_proj.shape[0])


#: the keys of Trainer's own training log, which its loop writes on every rank at the same step (take() is collective)
_TRAINING_LOG = ("loss", "learning_rate")


def with_load(logs: dict[str, Any], load: ExpertLoad | None, step: int | None = None) -> dict[str, Any]:
    """Trainer's training log (its loop's, with the loss and the learning rate) at `step` with the interval's
    `moe/*` metrics; any other log - evaluation, the end of train(), a log a callback or script writes on one rank -
    unchanged."""
    if load is None or not all(key in logs for key in _TRAINING_LOG):
        return logs
    return {**logs, **load.take(step)}
