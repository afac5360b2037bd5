"""THE table of kernel sites: where the kernels reach a transformers model family. Each site is a module with one
function, `patch(family, module)` (a ModelFamily entry and its imported modeling module), that patches the names
the family lists through patching.switch / patching.set_once and skips the names the installed release lacks.
patches/apply.py runs every site on every family, in this order. Adding a kernel: its site module here and in
SITES, and its op in OPS (docs/architecture.md, "How to add a kernel")."""

from __future__ import annotations

from .. import linear_attention, multimodal, talker
from . import experts, loss, rms_norm, rope, stacked_linear, swiglu

SITES = (rms_norm, swiglu, stacked_linear, rope, experts, loss, multimodal, linear_attention, talker)

#: The ops report() counts sites of (each a `kernels.<op>` setting of config/schema.py), in report()'s order.
OPS = ("rms_norm", "rope", "swiglu", "attention", "fused_linear_cross_entropy", "experts", "linear_attention")
#: Sites switched with an op of OPS but reported under a name of their own (patching.switch's `reported_as`):
#: report() lists their implementation and what ran, not a count.
REPORTED_AS = ("add_rms_norm", "stacked_linear")

__all__ = ["OPS", "REPORTED_AS", "SITES"]
