"""The stacked_linear site: the text attention's q/k/v projections as one stacked matmul where the backend stacks
(ops/linear.py), switched with the attention kernel (kernels.attention) and reported as stacked_linear."""

from __future__ import annotations

from types import ModuleType

from .. import forwards
from ..families import ModelFamily
from ..patching import switch


def patch(family: ModelFamily, module: ModuleType) -> None:
    """Switch the forward of the family's text attention class."""
    attention_cls = getattr(module, family.attention, None)
    if attention_cls is not None:
        switch(attention_cls, "forward", "attention", forwards.stacked_qkv_forward(attention_cls.forward),
               reported_as="stacked_linear")
