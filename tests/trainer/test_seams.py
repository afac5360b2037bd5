"""The private names of transformers / accelerate / PEFT / TRL / torch the package depends on: one list (seams.py),
each checked against the installed releases, a missing one fails at wiring time, naming the release; and a scan of
the package's source for private names of other code that are not listed."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import pathlib
import re
from collections.abc import Iterator

import pytest
import transformers
from packaging.version import Version
from snapshots import changed, transformers_symbols

import mindspeed_hf
from mindspeed_hf.releases import seams
from mindspeed_hf.trainers import wiring
from mindspeed_hf.trainers.fsdp import OVERRIDES

PACKAGE = pathlib.Path(mindspeed_hf.__file__).parent


@pytest.mark.parametrize("seam", seams.SEAMS, ids=lambda s: s.name)
def test_each_seam_exists_in_the_installed_release(seam):
    installed = seams._installed(seam.package)
    if installed is None:
        pytest.skip(f"{seam.name}: {seam.package} is not installed here")
    if not seams.in_range(seam):
        pytest.skip(f"{seam.name}: {seam.package} {seam.since}..{seam.until}; not used on {installed}")
    assert seams._present(seam), f"{seam.package} {installed} has no {seam.name}: {seam.why}"


def test_every_replaced_trainer_method_is_a_listed_seam():
    listed = {s.name for s in seams.SEAMS}
    assert set(OVERRIDES) <= listed


# ------------------------------------------------------------------------------- the scan for private names
#: Private names of other code that are not seams (not one of the supported packages).
NOT_SEAMS = {"_actions": "argparse.ArgumentParser's actions (Python's standard library)",
             "_kernel_repo": "the `kernels` package's mark on a layer it kernelized (transformers' hub kernels): read "
                             "only to name such a layer among the conflicts (trainers/frameworks.py); kernels is an "
                             "optional package none of our environments installs",
             "_current_frames": "sys._current_frames, documented (Python's standard library)",
             "_exit": "os._exit, documented (Python's standard library)"}
_GETATTR = {"getattr", "setattr", "hasattr", "delattr"}
_MAPPING_METHODS = {"get", "pop", "setdefault"}  # vars(obj).pop("_x") / obj.__dict__.get("_x")


def _private(name: object) -> bool:
    return (isinstance(name, str) and name.startswith("_") and not name.startswith("__") and name != "_"
            and name.isidentifier())


@dataclasses.dataclass
class Ours:
    """What the package itself defines: module-level names (per module) and the names of its classes (methods,
    class attributes, and `self._x = ...` instance attributes)."""

    module_level: set[str] = dataclasses.field(default_factory=set)
    class_level: set[str] = dataclasses.field(default_factory=set)

    def add(self, tree: ast.Module) -> None:
        for node in tree.body:
            self.module_level |= _bound_names(node)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in cls.body:
                self.class_level |= _bound_names(node)
            for node in ast.walk(cls):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
                    self.class_level.add(node.attr)


def _bound_names(node: ast.stmt) -> set[str]:
    """Names a statement binds at its own level (a def, a class, an assignment's plain names)."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, ast.Try | ast.If):
        return {name for child in (*node.body, *getattr(node, "orelse", ()), *getattr(node, "handlers", ()))
                for name in (_bound_names(child) if isinstance(child, ast.stmt) else
                             set().union(*(_bound_names(c) for c in child.body)))}
    return set()


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _our_imports(tree: ast.Module) -> set[str]:
    """Names a module binds to the package's own modules and objects (`from . import fsdp`, `import mindspeed_hf`)."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("mindspeed_hf")):
            bound |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("mindspeed_hf")}
    return bound


def _accesses(tree: ast.Module) -> Iterator[tuple[str, ast.expr | None, int]]:
    """(private name, the object it is read from or None, line) for every `obj._x`, getattr-family call with a
    constant `"_x"`, `mapping.get/pop/setdefault("_x")`, dict-literal key `"_x"` and `from pkg import _x`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            yield node.attr, node.value, node.lineno
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.func, ast.Name) \
                and node.func.id in _GETATTR and isinstance(node.args[1], ast.Constant) \
                and _private(node.args[1].value):
            yield node.args[1].value, node.args[0], node.lineno
        elif isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute) \
                and node.func.attr in _MAPPING_METHODS and isinstance(node.args[0], ast.Constant) \
                and _private(node.args[0].value):
            yield node.args[0].value, None, node.lineno
        elif isinstance(node, ast.Dict):
            for key in node.keys:
                if isinstance(key, ast.Constant) and _private(key.value):
                    yield key.value, None, key.lineno
        elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("mindspeed"):
            yield from ((a.name, None, node.lineno) for a in node.names if _private(a.name))


def _is_ours(name: str, obj: ast.expr | None, ours: Ours, imported: set[str]) -> bool:
    """`obj._name` is the package's own: a `_mindspeed*` name, an attribute of one of our modules, or a name our
    classes define (on `self` or on any other object: an instance of ours). A module-level name of ours does not
    make `tensor._x` ours."""
    if name.startswith("_mindspeed") or name in ours.class_level:
        return True
    if isinstance(obj, ast.Name) and obj.id in imported:
        return True
    return obj is None and name in ours.module_level


def private_names_used(sources: dict[str, str]) -> dict[str, list[str]]:
    """Every private name of other code that `sources` (path -> text, the package's modules) use: name ->
    ["path:line", ...]."""
    trees = {path: ast.parse(text) for path, text in sources.items()}
    ours = Ours()
    for tree in trees.values():
        ours.add(tree)
    used: dict[str, list[str]] = {}
    for path, tree in trees.items():
        imported = _our_imports(tree)
        for name, obj, line in _accesses(tree):
            if not _is_ours(name, obj, ours, imported):
                used.setdefault(name, []).append(f"{path}:{line}")
    return used


def _package_sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE.parent)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def _unlisted(used: dict[str, list[str]]) -> dict[str, list[str]]:
    listed = {s.attribute for s in seams.SEAMS} | set(NOT_SEAMS)
    return {name: where for name, where in used.items() if name not in listed}


def test_every_private_name_of_other_packages_is_a_listed_seam():
    used = private_names_used(_package_sources())
    assert {"_setup_devices", "_global_mapping", "_forward_hooks"} <= set(used), "the scan misses known names"
    assert _unlisted(used) == {}


#: Call sites that still name a private name directly although compat.py has its accessor, in modules this change
#: did not own (see the seam's `accessor`): name -> the modules. The test fails when one is routed, so the entry goes.
NOT_YET_ROUTED: dict[str, set[str]] = {}  # private name -> modules still to switch to its compat accessor


def test_a_name_with_an_accessor_is_used_only_in_compat():
    """A private name used in several modules goes through one compat.py function; nothing else names it."""
    from mindspeed_hf.releases import compat

    used = private_names_used(_package_sources())
    for seam in (s for s in seams.SEAMS if s.accessor is not None):
        assert callable(getattr(compat, seam.accessor, None)), seam.accessor
        elsewhere = {w.split(":")[0] for w in used.get(seam.attribute, [])} - {"mindspeed_hf/releases/compat.py"}
        assert elsewhere == NOT_YET_ROUTED.get(seam.attribute, set()), \
            f"{seam.attribute}: call compat.{seam.accessor} instead (or update NOT_YET_ROUTED)"


def test_each_listed_name_is_used():
    """No stale entry: every seam outside the Trainer's (which wiring reaches by name) is found by the scan."""
    used = private_names_used(_package_sources())
    trainer_kinds = {"method", "attribute", "module", "arguments", "accelerate"}
    stale = [s.name for s in seams.SEAMS if s.kind not in trainer_kinds and _private(s.attribute)
             and s.attribute not in used]
    assert stale == []


def test_a_missing_model_level_seam_is_named():
    """A required model-level seam the installed transformers lacks stops enable() (problems() names it)."""
    from transformers import PreTrainedModel

    with pytest.MonkeyPatch.context() as patch:
        patch.delattr(PreTrainedModel, "_supports_attention_backend")
        assert f"transformers {transformers.__version__} no longer has PreTrainedModel._supports_attention_backend" \
            in (seams.problems() or "")
    assert seams.problems() is None


def test_a_seam_of_one_feature_does_not_stop_enable(monkeypatch):
    import torch

    monkeypatch.delattr(torch._C, "_dispatch_key_for_device")
    seam = next(s for s in seams.SEAMS if s.name == "torch._C._dispatch_key_for_device")
    assert seam in seams.missing() and not seam.required and seams.problems() is None


PLANTED = {
    "mindspeed_hf/planted.py": """
import torch
from torch.distributed.tensor._utils import _explicit_order_placements
from . import fsdp

class Mine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self._cache = {}

    def forward(self, x):
        return len(self._cache) + len(self._state_dict_hooks)

def _helper(model, other):
    fsdp._keep_sharded(model)
    other._cache.clear()
    model.__dict__.pop("_mindspeed_config", None)
    setattr(model, "_mindspeed_mark", True)
    return getattr(model, "_pp_plan", 0), model._helper, torch._foreach_add, vars(model).get("_hf_hook")
""",
}


def test_the_scan_finds_a_planted_private_name():
    """The names of torch / transformers planted above are found, ours are not, and the listing check fails."""
    used = private_names_used(PLANTED)
    assert set(used) == {"_explicit_order_placements", "_state_dict_hooks", "_pp_plan", "_helper", "_foreach_add",
                         "_hf_hook"}
    assert used["_state_dict_hooks"] == ["mindspeed_hf/planted.py:12"]
    assert set(_unlisted(used)) == set(used)  # none of them is a seam: the package test would fail on them


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
def test_a_missing_required_seam_refuses_enable_and_changes_nothing(monkeypatch, restore_wiring):
    from transformers import Trainer

    from mindspeed_hf.trainers import enabling

    mindspeed_hf.disable()
    before = transformers_symbols()
    monkeypatch.delattr(Trainer, "_load_best_model")
    with pytest.raises(enabling.UnsupportedReleaseError, match="no longer has _load_best_model"):
        mindspeed_hf.enable()
    monkeypatch.undo()
    assert not mindspeed_hf.is_enabled() and not wiring.is_installed()
    assert changed(before, transformers_symbols()) == []


def test_a_failure_while_patching_puts_everything_back(monkeypatch, restore_wiring):
    """A family whose patching fails half-way (here the fourth) leaves the three before it restored too."""
    from mindspeed_hf.patches import apply

    mindspeed_hf.disable()
    before = transformers_symbols()
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
    assert changed(before, transformers_symbols()) == []
    monkeypatch.undo()
    mindspeed_hf.enable()  # and a later enable works
    assert changed(before, transformers_symbols()) != []
    mindspeed_hf.disable()
    assert changed(before, transformers_symbols()) == []


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


@pytest.mark.parametrize("seam", [s for s in seams.SEAMS if s.without is not None], ids=lambda s: s.name)
def test_an_optional_seam_says_what_runs_without_it(seam):
    if seam.package == "transformers":
        assert seam.since != "4.57" or seam.until is not None, "an optional seam must be dated"
    assert len(seam.without) > 20


@pytest.mark.parametrize("seam", seams.SEAMS, ids=lambda s: s.name)
def test_each_seam_names_its_package_and_where_to_find_it(seam):
    assert seam.package in seams.PACKAGES
    assert (seam.owner is None) == (seam.kind in {"method", "attribute", "module", "arguments", "accelerate"})
    assert seam.feature is None or seam.without is None, "a seam is optional or a feature's, not both"


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


def test_source_of_reads_source_and_leaves_linecache_as_it_was():
    """seams.source_of gives inspect.getsource's text without keeping a file in linecache that was not there (the
    seam checks read transformers' trainer.py once; its lines must not stay resident for the run)."""
    import linecache

    import transformers.trainer as hf_trainer

    path = inspect.getsourcefile(hf_trainer)
    linecache.cache.pop(path, None)
    assert seams.source_of(hf_trainer.Trainer.training_step) == inspect.getsource(hf_trainer.Trainer.training_step)
    assert path in linecache.cache  # inspect.getsource itself (the reference above) keeps it
    linecache.cache.pop(path, None)
    assert "def training_step" in seams.source_of(hf_trainer.Trainer.training_step)
    assert path not in linecache.cache
    linecache.getlines(path)  # cached by somebody else: left cached
    seams.source_of(hf_trainer.Trainer.training_step)
    assert path in linecache.cache
