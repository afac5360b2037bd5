"""The swiglu site: the family's SwiGLU MLPs (gate and up projections, or one packed gate_up projection) run the
swiglu kernel, switched by kernels.swiglu."""

from __future__ import annotations

from types import ModuleType

from .. import forwards
from ..families import ModelFamily
from ..patching import switch


def patch(family: ModelFamily, module: ModuleType) -> None:
    """Switch the forward of every MLP class the family lists."""
    for names, make in ((family.swiglu_mlp, forwards.swiglu_mlp_forward),
                        (family.packed_swiglu_mlp, forwards.packed_swiglu_mlp_forward)):
        for cls in (getattr(module, name) for name in names if hasattr(module, name)):
            switch(cls, "forward", "swiglu", make(cls.forward))
