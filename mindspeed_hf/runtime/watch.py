"""What ran, checked at the end of training: a kernel patched into a model that never executed over a span of
training (a Trainer's train(), an accelerate loop from `prepare` to `end_training` or exit) is said in one line,
with the cause where it is known. report()'s `ran` counters are the evidence: what executed, not what was patched.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from ..ops import registry, vocab_parallel
from ..patches import apply, scope

__all__ = ["fallbacks_since", "idle_kernels", "say_fallbacks", "snapshot"]

logger = logging.getLogger("mindspeed_hf")

#: an op and the other counters its executions go to in some runs (the fused loss on a tensor-parallel lm_head runs
#: as the vocab-parallel loss)
FORMS = {"fused_linear_cross_entropy": (vocab_parallel.OP,)}


def snapshot(model: nn.Module) -> dict[str, int] | None:
    """The model's kernel execution counters now (None: no transformers model inside, or none we accelerate)."""
    hf_model = apply.find_hf_model(model)
    if hf_model is None:
        return None
    return dict(scope.ran(hf_model))


def idle_kernels(model: nn.Module, before: dict[str, int]) -> tuple[list[str], dict[str, Any]]:
    """(the kernels patched into `model` whose counters did not move since `before`, the patches that other code
    replaced since enable())."""
    result = apply.report(model)
    replaced = apply.replacements(model)
    on = {op for op, n in result["kernels"].items() if n} | set(replaced.values())
    ran = result["ran"]
    idle = [op for op in result["kernels"] if op in on
            and all(ran.get(form, 0) == before.get(form, 0) for form in (op, *FORMS.get(op, ())))]
    return idle, replaced


def fallbacks_since(model: nn.Module, before: dict[str, int]) -> dict[str, int]:
    """Calls per op that a device kernel handed to the torch path since `before` (a snapshot)."""
    _, now = registry.split_fallbacks(snapshot(model) or {})
    _, then = registry.split_fallbacks(before)
    return {op: n - then.get(op, 0) for op, n in now.items() if n > then.get(op, 0)}


def say_fallbacks(model: nn.Module, before: dict[str, int], span: str) -> None:
    """One warning naming the calls that fell back to the torch path over `span` (e.g. "train()"), if any."""
    fell_back = fallbacks_since(model, before)
    if fell_back:
        logger.warning("mindspeed_hf: %s, %s fell back to the torch path (the warning before says why)", span,
                       ", ".join(f"{op} x{n:,}" for op, n in fell_back.items()))
