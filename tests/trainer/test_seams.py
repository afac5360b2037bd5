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
    assert seams._present(seam), f"transformers {transformers.__version__} has no {seam.name}: {seam.why}"


def test_every_replaced_trainer_method_is_a_listed_seam():
    listed = {s.name for s in seams.SEAMS}
    assert set(OVERRIDES) <= listed


def test_no_other_private_trainer_name_is_used():
    """Every `trainer._name` / `Trainer._name` the package touches is either ours (`_mindspeed_*`) or listed."""
    listed = {s.name for s in seams.SEAMS}
    used = set()
    for path in (PACKAGE / "trainers").glob("*.py"):
        used |= set(re.findall(r"\btrainer\.(_[a-z][a-z_]*)", path.read_text()))
    assert {name for name in used if not name.startswith("_mindspeed")} <= listed


def test_no_trainer_method_body_is_copied():
    """No function of the package carries a Trainer method's body: compare every function's code lines with
    every Trainer method's (a copy of 6+ consecutive lines would show)."""
    from transformers import Trainer

    def lines(fn) -> list[str]:
        return [ln.strip() for ln in inspect.getsource(fn).splitlines()[1:] if ln.strip()
                and not ln.strip().startswith(("#", '"""'))]

    theirs = set()
    for _, method in inspect.getmembers(Trainer, inspect.isfunction):
        body = lines(method)
        theirs |= {tuple(body[i:i + 6]) for i in range(len(body) - 5)}
    for path in (PACKAGE / "trainers").glob("*.py"):
        module = inspect.getmodulename(str(path))
        mod = __import__(f"mindspeed_hf.trainers.{module}", fromlist=["x"])
        for _, fn in inspect.getmembers(mod, inspect.isfunction):
            if fn.__module__ != mod.__name__:
                continue
            body = lines(fn)
            copied = [body[i:i + 6] for i in range(len(body) - 5) if tuple(body[i:i + 6]) in theirs]
            assert not copied, f"{mod.__name__}.{fn.__name__} repeats Trainer code: {copied[0]}"


def test_a_missing_seam_fails_loudly_at_wiring_time(monkeypatch, restore_wiring):
    from transformers import Trainer

    wiring.uninstall_trainer_wiring()
    monkeypatch.delattr(Trainer, "_load_best_model")
    with pytest.raises(RuntimeError, match=rf"transformers {re.escape(transformers.__version__)} no longer has "
                                           r"_load_best_model .*supports transformers 4.57 to 5.x"):
        wiring.install_trainer_wiring()
    assert not wiring.is_installed()


def test_a_seam_newer_than_the_release_is_not_required():
    late = [s for s in seams.SEAMS if s.since != "4.57"]
    assert late, "the list has seams that only newer releases have"
    assert seams.missing(Version("4.57.0")) == [s for s in seams.SEAMS if s.since == "4.57" and not seams._present(s)]
