"""The internal names of transformers / accelerate the Trainer integration depends on: one list (seams.py), each
checked against the installed releases, and a missing one fails at wiring time, naming the release."""

from __future__ import annotations

import inspect
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
    """A seam that arrived in transformers 5 is not asked of 4.57, and is asked of 5.x."""
    from transformers import Trainer

    late = next(s for s in seams.SEAMS if s.kind == "method" and s.since == "5.0")
    monkeypatch.delattr(Trainer, late.name, raising=False)  # absent, as in 4.57
    assert late not in seams.missing(Version("4.57.6"))
    assert late in seams.missing(Version("5.0.0"))
