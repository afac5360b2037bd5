"""The documentation: the generated pages hold every setting and every command, every marker resolves, every
relative link of the README and of the pages points at a file that exists, and the README stays a front page.
(`.ci/run` builds the site itself with `mkdocs build --strict`.)"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from mindspeed_hf.cli.parsers import COMMANDS
from mindspeed_hf.config.schema import settings

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_settings_page_lists_every_setting():
    page = _hooks().expand((DOCS / "reference" / "settings.md").read_text())
    for s in settings():
        assert f"| `{s.path}` |" in page and f"`{s.env}`" in page and f"`--{s.argument}`" in page, s.path
    assert "<!--" not in page


def test_commands_page_is_each_commands_own_help():
    page = _hooks().expand((DOCS / "reference" / "commands.md").read_text())
    for command in COMMANDS.values():
        assert command.parser().format_help().rstrip() in page, command.name


def test_every_page_expands():
    for page in DOCS.rglob("*.md"):
        text = _hooks().expand(page.read_text())
        assert not re.search(r"<!-- (generated|include):", text), page


def test_a_bad_marker_is_an_error():
    with pytest.raises(FileNotFoundError, match="benchmarks/results/nothing.md"):
        _hooks().expand("<!-- include: benchmarks/results/nothing.md -->")
    with pytest.raises(KeyError, match="no generated page 'nothing'"):
        _hooks().expand("<!-- generated: nothing -->")


@pytest.mark.parametrize("page", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md"))])
def test_relative_links_resolve(page):
    path = ROOT / page
    for target in _LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        assert (path.parent / target.split("#")[0]).exists(), f"{page}: {target}"


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, len(lines)


_REPO_PATH = re.compile(r"\b((?:mindspeed_hf|tests|benchmarks|examples|docs)/[\w/.-]*\w\.(?:py|md|yaml|sh))\b")


@pytest.mark.parametrize("page", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md"))])
def test_named_repository_files_exist(page):
    """A file of this repository that a page names (`examples/custom_loop.py`) exists: moving it fails here. (A line
    about transformers' own checkout, HF_CHECKOUT, names its files, not ours.)"""
    lines = [line for line in (ROOT / page).read_text().splitlines() if "HF_CHECKOUT" not in line]
    missing = [p for p in _REPO_PATH.findall("\n".join(lines)) if not (ROOT / p).exists()]
    assert not missing, f"{page}: {missing}"
