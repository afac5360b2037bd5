"""The internal names of transformers / accelerate the Trainer integration depends on: one list (seams.py), each
checked against the installed releases, and a missing one fails at wiring time, naming the release."""

from __future__ import annotations

import inspect
import os
import pathlib
import re

import pytest
import transformers
from packaging.version import Version

import mindspeed_hf
from mindspeed_hf.trainers import seams, wiring
from mindspeed_hf.trainers.fsdp import OVERRIDES

PACKAGE = pathlib.Path(mindspeed_hf.__file__).parent


@pytest.mark.parametrize("seam", seams.SEAMS, ids=lambda s: s.name)
def test_each_seam_exists_in_the_installed_release(seam):
    if Version(transformers.__version__) < Version(seam.since):
        pytest.skip(f"{seam.name} arrived in transformers {seam.since}; not used on {transformers.__version__}")
    if seam.until is not None and Version(transformers.__version__) >= Version(seam.until):
        pytest.skip(f"{seam.name} left in transformers {seam.until}; not used on {transformers.__version__}")
    assert seams._present(seam), f"transformers {transformers.__version__} has no {seam.name}: {seam.why}"


def test_every_replaced_trainer_method_is_a_listed_seam():
    listed = {s.name for s in seams.SEAMS}
    assert set(OVERRIDES) <= listed


def test_no_other_private_trainer_name_is_used():
    """Every `trainer._name` / `Trainer._name` / `accelerator._name` the package touches is either ours
    (`_mindspeed_*`) or listed."""
    listed = {s.name for s in seams.SEAMS}
    used = set()
    for path in (PACKAGE / "trainers").glob("*.py"):
        text = path.read_text()
        used |= set(re.findall(r"\b[tT]rainer\.(_[a-z][a-z_]*)", text))
        used |= {f"Accelerator.{name}" for name in re.findall(r"\baccelerator\.(_[a-z][a-z_]*)", text)}
    assert used, "the scan found no internal name at all: the pattern is wrong"
    assert {name for name in used if not name.startswith("_mindspeed")} <= listed


_SYNTAX = {"try:", "else:", "finally:", "yield", "return", "pass"}


def _code_lines(source: str) -> list[str]:
    """A function's body lines without comments and docstring lines, normalised: whitespace dropped and
    `self.` / `trainer.` (a method body moved into a function) removed."""
    out = []
    for line in source.splitlines()[1:]:
        text = line.strip()
        if text and not text.startswith(("#", '"""')) and text not in _SYNTAX:
            out.append(re.sub(r"\s+", "", re.sub(r"\b(self|trainer)\.", "", text)))
    return out


def _windows(lines: list[str], n: int = 3) -> set[tuple[str, ...]]:
    return {tuple(lines[i:i + n]) for i in range(len(lines) - n + 1)}


def copied_trainer_code(source: str) -> list[tuple[str, tuple[str, ...]]]:
    """(function name, lines) for every 3 consecutive code lines of a function in `source` that also stand
    consecutively in a transformers.Trainer method."""
    import ast

    from transformers import Trainer

    theirs = set()
    for _, method in inspect.getmembers(Trainer, inspect.isfunction):
        theirs |= _windows(_code_lines(inspect.getsource(method)))
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found += [(node.name, w) for w in _windows(_code_lines(ast.get_source_segment(source, node)))
                      if w in theirs]
    return found


def test_no_trainer_method_body_is_copied():
    for path in (PACKAGE / "trainers").glob("*.py"):
        assert copied_trainer_code(path.read_text()) == [], path.name


def test_the_copy_check_finds_a_copy():
    """The check above catches the copied `_save_checkpoint` body an earlier release carried."""
    copy = '''
def _save_checkpoint(trainer, original, model, trial=None):
    args, state = trainer.args, trainer.state
    if trainer.hp_search_backend is None and trial is None:
        trainer.store_flos()
    run_dir = trainer._get_output_dir(trial=trial)
'''
    assert copied_trainer_code(copy)


def test_a_missing_seam_fails_loudly_at_wiring_time(monkeypatch, restore_wiring):
    from transformers import Trainer

    wiring.uninstall_trainer_wiring()
    monkeypatch.delattr(Trainer, "_load_best_model")
    with pytest.raises(RuntimeError, match=rf"transformers {re.escape(transformers.__version__)} no longer has "
                                           r"_load_best_model .*supports transformers 4.57 to 5.x"):
        wiring.install_trainer_wiring()
    assert not wiring.is_installed()


def test_a_missing_accelerate_seam_names_accelerate(monkeypatch, restore_wiring):
    import accelerate

    wiring.uninstall_trainer_wiring()
    monkeypatch.delattr(accelerate.Accelerator, "_prepare_device_mesh")
    with pytest.raises(RuntimeError, match=rf"accelerate {re.escape(accelerate.__version__)} no longer has "
                                           r"Accelerator._prepare_device_mesh "):
        wiring.install_trainer_wiring()
    assert not wiring.is_installed()


def test_a_seam_newer_than_the_release_is_not_required(monkeypatch):
    """A seam that arrived in transformers 5.23 is not asked of 5.22, is listed missing on 5.23 when absent, and
    (being optional) does not stop enable() there."""
    from transformers import Trainer

    late = next(s for s in seams.SEAMS if s.kind == "method" and s.since == "5.23")
    monkeypatch.delattr(Trainer, late.name, raising=False)  # absent, as in 4.57 .. 5.22
    assert late not in seams.missing(Version("5.22.0"))
    assert late in seams.missing(Version("5.23.0"))
    assert not late.required and not seams.available(late.name)
    assert seams.problems() is None


# ------------------------------------------------------------------------------------------ all or nothing
def _transformers_symbols() -> dict[str, object]:
    """Every attribute of transformers' model modules and of their classes, Trainer and TrainingArguments, and the
    names in the attention / mask / experts registries: what enable() may change (the families' modules are
    imported first, so that importing them is not counted as a change)."""
    import sys

    from mindspeed_hf.patches import apply
    from mindspeed_hf.patches.families import FAMILIES

    for family in FAMILIES.values():
        apply._modeling(family)

    from transformers import AttentionInterface, Trainer, TrainingArguments
    from transformers.masking_utils import AttentionMaskInterface

    found: dict[str, object] = {}
    modules = [m for name, m in list(sys.modules.items()) if name.startswith("transformers.models.") and m]
    for module in modules:
        for name, value in list(vars(module).items()):
            found[f"{module.__name__}.{name}"] = value
            if isinstance(value, type) and value.__module__ == module.__name__:
                found.update({f"{module.__name__}.{name}.{k}": v for k, v in vars(value).items()})
    for cls in (Trainer, TrainingArguments):
        found.update({f"{cls.__name__}.{k}": v for k, v in vars(cls).items()})
    for interface in (AttentionInterface, AttentionMaskInterface):
        found[interface.__name__] = tuple(sorted(interface._global_mapping))
    from mindspeed_hf import compat

    experts = compat.experts_registry()
    if experts is not None:
        found["experts"] = tuple(sorted(experts.functions._global_mapping))
    return found


def _changed(before: dict, after: dict) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k, None) is not after.get(k, None)
                  and before.get(k) != after.get(k))


def test_a_missing_required_seam_refuses_enable_and_changes_nothing(monkeypatch, restore_wiring):
    from transformers import Trainer

    from mindspeed_hf.trainers import enabling

    mindspeed_hf.disable()
    before = _transformers_symbols()
    monkeypatch.delattr(Trainer, "_load_best_model")
    with pytest.raises(enabling.UnsupportedReleaseError, match="no longer has _load_best_model"):
        mindspeed_hf.enable()
    monkeypatch.undo()
    assert not mindspeed_hf.is_enabled() and not wiring.is_installed()
    assert _changed(before, _transformers_symbols()) == []


def test_a_failure_while_patching_puts_everything_back(monkeypatch, restore_wiring):
    """A family whose patching fails half-way (here the fourth) leaves the three before it restored too."""
    from mindspeed_hf.patches import apply

    mindspeed_hf.disable()
    before = _transformers_symbols()
    calls = []
    original = apply._patch_family

    def patch_family(family):
        calls.append(family.name if hasattr(family, "name") else family)
        if len(calls) == 4:
            raise RuntimeError("boom")
        original(family)

    monkeypatch.setattr(apply, "_patch_family", patch_family)
    with pytest.raises(RuntimeError, match="boom"):
        mindspeed_hf.enable()
    assert len(calls) == 4 and not mindspeed_hf.is_enabled() and not wiring.is_installed()
    assert _changed(before, _transformers_symbols()) == []
    monkeypatch.undo()
    mindspeed_hf.enable()  # and a later enable works
    assert _changed(before, _transformers_symbols()) != []
    mindspeed_hf.disable()
    assert _changed(before, _transformers_symbols()) == []


def test_import_on_a_release_without_a_required_seam_warns_once_and_patches_nothing(tmp_path):
    """Run in a fresh process: the seam is removed before `import mindspeed_hf`."""
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(
        "import transformers\n"
        "del transformers.Trainer._load_best_model\n"
        "from transformers.models.llama import modeling_llama as m\n"
        "before = dict(vars(m.LlamaRMSNorm))\n"
        "import mindspeed_hf\n"
        "from mindspeed_hf.trainers import wiring\n"
        "assert not mindspeed_hf.is_enabled() and not wiring.is_installed()\n"
        "assert dict(vars(m.LlamaRMSNorm)) == before\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_HF_AUTO"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "mindspeed_hf" in line]
    assert len(warnings) == 1 and "no longer has _load_best_model" in warnings[0], done.stderr
    assert "nothing was patched" in warnings[0]


@pytest.mark.parametrize("seam", [s for s in seams.SEAMS if not s.required], ids=lambda s: s.name)
def test_an_optional_seam_says_what_runs_without_it(seam):
    assert seam.since != "4.57" or seam.until is not None, "an optional seam must be dated"
    assert len(seam.without) > 20


def test_seams_that_some_releases_lack_are_optional_or_dated():
    """transformers 5.6 .. 5.22 (pinned by LLaMA-Factory, ms-swift, axolotl) lack _defer_fsdp_gradient_reduction, and
    5.6 is_distributed_loading_by_transformers: both optional, so those releases are served."""
    by_name = {s.name: s for s in seams.SEAMS}
    assert not by_name["_defer_fsdp_gradient_reduction"].required
    assert not by_name["is_distributed_loading_by_transformers"].required
    gone = [s.name for s in seams.missing(Version("5.6.0")) if s.required]
    assert gone == [] or Version(transformers.__version__) != Version("5.6.0")


def test_disable_removes_every_attention_we_registered():
    """Ours and context parallelism's ("mindspeed_cp"): transformers' registries are as before enable()."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    import mindspeed_hf
    from mindspeed_hf.parallel.context.model import CP_ATTENTION, register_cp_attention

    mindspeed_hf.disable()
    before = [dict(i._global_mapping) for i in (AttentionInterface, AttentionMaskInterface)]
    mindspeed_hf.enable()
    register_cp_attention()
    assert CP_ATTENTION in AttentionInterface._global_mapping and "mindspeed" in AttentionMaskInterface._global_mapping
    mindspeed_hf.disable()
    assert [dict(i._global_mapping) for i in (AttentionInterface, AttentionMaskInterface)] == before
