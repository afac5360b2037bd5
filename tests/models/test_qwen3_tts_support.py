"""Qwen3-TTS support in every environment: the family is declared for the qwen-tts modeling module without importing
it, and on transformers 5 the example says clearly that qwen-tts needs 4.57 instead of failing deep inside it."""

from __future__ import annotations

import sys

import pytest
import transformers
from child_runs import REPO

from mindspeed_hf.patches import FAMILIES

sys.path.insert(0, str(REPO / "examples" / "qwen3_tts"))
from qwen_tts_loader import import_qwen_tts  # noqa: E402


def test_family_points_at_the_third_party_module():
    family = FAMILIES["qwen3_tts"]
    assert family.modeling_module == "qwen_tts.core.models.modeling_qwen3_tts"
    assert family.mrope_attention == (("Qwen3TTSTalkerAttention", "apply_multimodal_rotary_pos_emb"),)


def test_enable_does_not_import_qwen_tts(monkeypatch):
    import importlib

    import mindspeed_hf

    imported = []
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: imported.append(name) or real(name, *a))
    mindspeed_hf.enable()
    assert imported and not any(name.startswith("qwen_tts") for name in imported)


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5, reason="transformers 5 only")
def test_transformers_5_is_refused_with_the_reason():
    with pytest.raises(RuntimeError, match=r"needs transformers 4\.57\.x .*cache= instead of past_key_values="):
        import_qwen_tts()


def test_a_third_party_module_is_patched_when_it_is_imported(tmp_path, monkeypatch):
    """The import watch behind third-party families: the callback runs right after the module's code, only for the
    watched name, and stop_watching() leaves sys.meta_path as it was."""
    from mindspeed_hf.patches import third_party

    (tmp_path / "msfake_modeling.py").write_text("class Norm:\n    def forward(self):\n        return 'theirs'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    finders = list(sys.meta_path)
    seen = []
    third_party.when_imported("msfake_modeling", lambda module: seen.append(module.Norm.forward(None)))
    assert seen == [] and "msfake_modeling" not in sys.modules
    import msfake_modeling  # noqa: F401

    assert seen == ["theirs"]
    third_party.stop_watching()
    assert sys.meta_path == finders
    monkeypatch.delitem(sys.modules, "msfake_modeling")
