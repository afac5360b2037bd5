"""The experts site: a MoE family's default experts implementation (no request) becomes ours while kernels.experts
is on (patches/experts.py; transformers >= 5 only, which has the experts registry)."""

from __future__ import annotations

from types import ModuleType

from .. import experts
from ..families import ModelFamily
from ..patching import set_once


def patch(family: ModelFamily, module: ModuleType) -> None:
    """Wrap the family's XPreTrainedModel.get_correct_experts_implementation."""
    if family.experts and experts.available():
        pretrained = getattr(module, family.pretrained)
        set_once(pretrained, "get_correct_experts_implementation",
                 experts.default_wrapper(pretrained.get_correct_experts_implementation))
