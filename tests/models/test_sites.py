"""The table of kernel sites (mindspeed_hf/patches/sites: SITES) is the one place a kernel site is wired: every
attribute enable() patches on a transformers family is one site's or the model wiring's (attention default, flash
check, post_init), no two sites patch the same attribute, and every switched site runs under an op report() knows
(sites.OPS counted, sites.REPORTED_AS listed)."""

import importlib
import inspect

from mindspeed_hf.patches import apply, experts
from mindspeed_hf.patches.engine import PATCHES
from mindspeed_hf.patches.families import FAMILIES
from mindspeed_hf.patches.sites import OPS, REPORTED_AS, SITES

# apply._patch_family's model-class wiring, outside the table (not a kernel)
WIRING = {"get_correct_attn_implementation", "_check_and_adjust_attn_implementation", "post_init"}
# the hybrid text models' forwards, switched with linear_attention to find packed documents: not a kernel site
NOT_KERNELS = {"packed_documents"}


def _import_every_family() -> None:
    """Every transformers family's modeling module this release has: enable() patches a family when its module is
    imported, so the record below must not depend on which modules earlier tests imported."""
    for family in FAMILIES.values():
        if not family.modeling:
            try:
                importlib.import_module(family.modeling_module)
            except ImportError:  # a family this release lacks
                pass


def _record(monkeypatch, sites: tuple) -> dict:
    """{(id(owner), name): patch} that enable() leaves with only `sites` in the table."""
    _import_every_family()
    apply.disable()
    monkeypatch.setattr(apply, "SITES", sites)
    apply.enable()
    record = dict(PATCHES._patches)
    apply.disable()
    return record


def _from_transformers(patch) -> bool:
    owner = patch.owner
    return (getattr(owner, "__module__", None) or getattr(owner, "__name__", "")).startswith("transformers.")


def test_every_site_has_the_one_entry():
    assert all(list(inspect.signature(site.patch).parameters) == ["family", "module"] for site in SITES)
    assert len(set(SITES)) == len(SITES)


def test_every_patched_attribute_is_one_sites_or_the_wiring(monkeypatch):
    full = _record(monkeypatch, SITES)
    outside = _record(monkeypatch, ())  # the model wiring (and diffusers' denoisers, when imported: their own table)
    assert {p.name for p in outside.values() if _from_transformers(p)} == WIRING
    seen: dict = {}
    for site in SITES:
        own = {key: patch for key, patch in _record(monkeypatch, (site,)).items() if key not in outside}
        assert own or (site.__name__.endswith("sites.experts") and not experts.available()), site.__name__
        assert not own.keys() & seen.keys(), (site.__name__, [own[k].name for k in own.keys() & seen.keys()])
        seen.update(own)
    assert seen.keys() | outside.keys() == full.keys()


def test_every_switched_site_runs_under_an_op_report_knows(monkeypatch):
    ops = {getattr(patch.value, "_mindspeed_op", None) for patch in _record(monkeypatch, SITES).values()}
    assert ops - {None} <= {*OPS, *REPORTED_AS, *NOT_KERNELS}
    assert {"rms_norm", "rope", "swiglu", "attention", "fused_linear_cross_entropy", *REPORTED_AS} <= ops
