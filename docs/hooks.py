"""MkDocs hook: the pages that must not drift from the code are generated when the site is built.

A page holds a marker where generated text goes:

* `<!-- generated: settings -->`: every setting of `mindspeed_hf/config/schema.py` (its YAML key, environment
  variable, training argument, value kind, default and help), one table per section;
* `<!-- generated: commands -->`: every subcommand's `--help`, from the parsers the command itself uses
  (`mindspeed_hf/cli/parsers.py`);
* `<!-- include: benchmarks/results/NAME.md -->`: a benchmark's results file as written by its benchmark, so a
  figure quoted in the docs is the one the benchmark produced.

`tests/test_docs.py` checks the markers resolve and every setting and command appears; `.ci/run` builds the site
with `mkdocs build --strict`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

os.environ.setdefault("MINDSPEED_HF_AUTO", "0")  # reading the declarations patches nothing

ROOT = Path(__file__).resolve().parent.parent
_MARKER = re.compile(r"<!-- (generated|include): ([\w./-]+) -->")


def _cell(value: object) -> str:
    text = "" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _default(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return "-" if value is None else str(value)


def settings_markdown() -> str:
    """Every declared setting, a table per section, in declaration order."""
    from mindspeed_hf.config.schema import SECTIONS, MindSpeedConfig, settings

    docs = {None: MindSpeedConfig.__doc__, **{name: cls.__doc__ for name, cls in SECTIONS.items()}}
    out: list[str] = []
    section = object()
    for s in settings():
        if s.section != section:
            section = s.section
            title = "Top level" if section is None else f"`{section}`"
            doc = " ".join((docs[section] or "").split())
            out += ["", f"## {title}", "", doc, "",
                    "| setting | values | default | environment variable | training argument | what it does |",
                    "|---|---|---|---|---|---|"]
        out.append(f"| `{s.path}` | {_cell(s.kind)} | `{_default(s.default)}` | `{s.env}` | `--{s.argument}` | "
                   f"{_cell(s.help)} |")
    return "\n".join(out).strip() + "\n"


def commands_markdown() -> str:
    """Every subcommand's `--help`, from the command's own parsers."""
    from mindspeed_hf.cli.parsers import COMMANDS, usage

    out = ["```text", "$ mindspeed-hf --help", usage(), "```"]
    for command in COMMANDS.values():
        out += ["", f"## `mindspeed-hf {command.name}`", "", command.summary[0].upper() + command.summary[1:] + ".",
                "", "```text", f"$ mindspeed-hf {command.name} --help", command.parser().format_help().rstrip(),
                "```"]
    return "\n".join(out) + "\n"


_GENERATED = {"settings": settings_markdown, "commands": commands_markdown}


def _include(path: str) -> str:
    target = (ROOT / path).resolve()
    if ROOT not in target.parents or not target.is_file():
        raise FileNotFoundError(f"docs include: {path} is not a file of the repository")
    text = target.read_text()
    # the file's own title becomes a line of its own: the page has its title already
    return re.sub(r"^# (.*)$", r"**\1**", text, count=1, flags=re.M)


def expand(markdown: str) -> str:
    """`markdown` with every marker replaced by what it names."""
    def replace(match: re.Match) -> str:
        kind, name = match.groups()
        if kind == "include":
            return _include(name)
        if name not in _GENERATED:
            raise KeyError(f"docs marker: no generated page {name!r} (one of {', '.join(_GENERATED)})")
        return _GENERATED[name]()

    return _MARKER.sub(replace, markdown)


def on_page_markdown(markdown: str, **kwargs) -> str:  # noqa: D103 - MkDocs' hook
    return expand(markdown)


__all__ = ["commands_markdown", "expand", "settings_markdown"]
