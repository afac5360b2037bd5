"""The loss site: the family's causal-LM heads compute the fused chunked linear cross-entropy (no [tokens, vocab]
logits), switched by kernels.fused_linear_cross_entropy (patches/causal_lm.py). (VLM heads: multimodal.py; the
Omni talkers: talker.py.)"""

from __future__ import annotations

from types import ModuleType

from .. import causal_lm
from ..families import ModelFamily
from ..patching import switch


def patch(family: ModelFamily, module: ModuleType) -> None:
    """Switch the forward of every causal-LM head class the family lists."""
    for name in family.causal_lm:
        cls = getattr(module, name)
        switch(cls, "forward", "fused_linear_cross_entropy", causal_lm.laid_out_as(cls.forward))
