"""Value kinds of the settings of mindspeed_hf.config: true/false, a bounded integer, one of some names, a choice
that may also be given as a bool, a list of choices, a layer selection. Each kind checks a value (YAML or Python) and
reads text (a MINDSPEED_HF_* variable, an accelerate launch variable, a command-line flag), returning the canonical
value or raising a one-line ValueError that names the setting (as its source spells it) and the valid choices."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Kind:
    """A setting's value kind. `check(where, value)` returns the canonical value or raises ValueError naming `where`;
    `read(where, text)` does the same for text (`parse`, where the kind has one, turns the text into a value the
    check then takes; without it `check` reads text too).

    A Kind is also the setting's training-argument type: argparse calls it on the flag's text, unless `argument`
    names a plain type (bool, int, str) that HfArgumentParser reads its own way. `parser_options` go to the flag as
    well (`nargs="?"` and `const=True` keep a bare `--flag` meaning true); `choices`, where the kind has a fixed
    set, too. `fold_case`: text in any case means the lower-case choice."""

    name: str
    check: Callable[[str, Any], Any]
    parser_options: tuple[tuple[str, Any], ...] = ()
    parse: Callable[[str, str], Any] | None = None
    argument: type | None = None
    choices: tuple[str, ...] | None = None
    fold_case: bool = False

    def read(self, where: str, text: str) -> Any:
        """The value a text gives (a variable's, named `where` in errors)."""
        return self.parse(where, text) if self.parse is not None else self.check(where, text)

    def __call__(self, text: str) -> Any:
        try:
            return self.check("value", text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    def __repr__(self) -> str:
        return self.name


def _words(text: str) -> list[str]:
    """`a,b`, `[a, b]` or `a`: the items of a list given as text."""
    return [w.strip() for w in text.strip().strip("[]").split(",") if w.strip()]


_TRUE = ("true", "on", "yes", "1")
_FALSE = ("false", "off", "no", "0")


def parse_flag(value: Any, where: str) -> bool:
    """A bool, or its text (true/on/yes/1, false/off/no/0, any case); anything else is a one-line error naming
    `where`. The one reading of a true/false setting, whatever its source (YAML, variable, argument)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"{where}={value!r} must be true or false")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def boolean() -> Kind:
    """true or false: a bool as a value (text such as 'yes' is refused there), parse_flag's reading as text. The
    training argument stays a plain bool (HfArgumentParser's own reading of `--flag [value]`)."""

    def check(where: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}={value!r} must be true or false")
        return value

    return Kind("true or false", check, parse=lambda where, text: parse_flag(text, where), argument=bool)


def integer(minimum: int, note: str = "", also: int | None = None) -> Kind:
    """An integer >= `minimum` (or equal to `also`, a special value whose meaning `note` gives); as text, its digits.
    The training argument stays a plain int."""

    def check(where: str, value: Any) -> int:
        if not _is_int(value):
            raise ValueError(f"{where}={value!r} must be an integer")
        if value < minimum and value != also:
            raise ValueError(f"{where}={value} must be >= {minimum}{note}")
        return value

    def parse(where: str, text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{where}={text!r} must be an integer") from None

    return Kind(f"an integer >= {minimum}{note}", check, parse=parse, argument=int)


def choice(choices: tuple[str, ...], fold_case: bool = False) -> Kind:
    """One of `choices`, a string. As text it is checked at once, so the error names the variable; `fold_case`: text
    is read whatever its case and spaces (and a training argument's value whatever its case)."""
    valid = ", ".join(choices)

    def chosen(where: str, value: str, given: Any) -> str:
        if value not in choices:
            raise ValueError(f"{where}={given!r} is not valid; choose one of {valid}")
        return value

    def check(where: str, value: Any) -> str:
        if not isinstance(value, str):
            raise ValueError(f"{where}={value!r} must be a string")
        return chosen(where, value, value)

    def parse(where: str, text: str) -> str:
        return chosen(where, text.strip().lower() if fold_case else text, text)

    return Kind(f"one of {valid}", check, parse=parse, argument=str, choices=choices, fold_case=fold_case)


def choice_or_bool(choices: tuple[str, ...], true_means: str) -> Kind:
    """False, or one of `choices`. True (and the text true/on/yes/1) is the choice `true_means`, whose canonical
    value is True; false/off/no/0 are False; any other choice is kept as its (lower-case) name."""
    valid = ", ".join(("false", *choices))

    def check(where: str, value: Any) -> bool | str:
        if isinstance(value, bool):
            return value
        text = value.strip().lower() if isinstance(value, str) else None
        if text in _TRUE or text == true_means:
            return True
        if text in _FALSE:
            return False
        if text in choices:
            return text
        raise ValueError(f"{where}={value!r} is not valid; choose one of {valid} (true means {true_means})")

    return Kind(f"one of {valid}", check, (("nargs", "?"), ("const", True)))


def choice_list(choices: tuple[str, ...]) -> Kind:
    """A non-empty list of names out of `choices` (as text: comma-separated); duplicates dropped, order kept."""

    def check(where: str, value: Any) -> list[str]:
        items = _words(value) if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not items or not all(isinstance(i, str) for i in items):
            raise ValueError(f"{where}={value!r} must be a non-empty list of: {', '.join(choices)}")
        bad = [i for i in items if i not in choices]
        if bad:
            raise ValueError(f"{where}={value!r}: {', '.join(bad)} not valid; choose from {', '.join(choices)}")
        return list(dict.fromkeys(items))

    return Kind(f"a list of {', '.join(choices)}", check)


def _selection(where: str, value: Any) -> str | int | list[int]:
    original = value
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "all":
            return "all"
        try:
            value = [int(w) for w in _words(text)] if ("," in text or text.startswith("[")) else int(text)
        except ValueError:
            pass
    if _is_int(value) and value >= 1:
        return value
    if isinstance(value, (list, tuple)) and value and all(_is_int(i) and i >= 0 for i in value):
        return sorted(set(value))
    raise ValueError(f"{where}={original!r} is not valid; choose all, an integer n >= 1 (every n-th layer) or a "
                     "non-empty list of layer indices >= 0")


def layer_selection() -> Kind:
    """`all`, an integer n >= 1 (every n-th layer: 0, n, 2n, ...) or a list of layer indices (as text `0,2,5`, or
    `[3]` for a single index)."""
    return Kind("all, n or a list of layer indices", _selection)


def flag() -> Kind:
    """true or false (parse_flag's reading); a bare command-line flag means true."""
    return Kind("true or false", lambda where, value: parse_flag(value, where), (("nargs", "?"), ("const", True)))


def positive_number() -> Kind:
    """A number > 0 (an int or a float; as text, its decimal or exponent form)."""

    def check(where: str, value: Any) -> float:
        number = value
        if isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                number = None
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not number > 0:
            raise ValueError(f"{where}={value!r} must be a number > 0")
        return float(number)

    return Kind("a number > 0", check, argument=float)


def non_negative_int(unit: str = "") -> Kind:
    """An integer >= 0 (as text: its digits); `unit` names what it counts, in the error."""

    def check(where: str, value: Any) -> int:
        number = value
        if isinstance(value, str):
            try:
                number = int(value.strip())
            except ValueError:
                number = None
        if not _is_int(number) or number < 0:
            raise ValueError(f"{where}={value!r} must be an integer >= 0{f' ({unit})' if unit else ''}")
        return number

    return Kind(f"an integer >= 0{f' ({unit})' if unit else ''}", check)


def unknown_names(what: str, unknown: Iterable[str], valid: Iterable[str]) -> ValueError:
    """One line for names nobody declared: each with the nearest valid name (or, when none is near, the valid names
    if there are few, else where to find them), e.g. `unknown config key parallel.dpshard (did you mean
    parallel.dp_shard?)`."""
    valid = list(valid)
    by_last = {v.rsplit(".", 1)[-1]: v for v in valid}  # `section.key`: compared by the key alone
    parts = []
    for name in sorted(unknown):
        near = difflib.get_close_matches(name.rsplit(".", 1)[-1], list(by_last), n=1, cutoff=0.7)
        parts.append(f"{name} (did you mean {by_last[near[0]]}?)" if near else name)
    hint = f"; valid {what}s: {', '.join(valid)}" if len(valid) <= 12 else ""
    plural = "s" if len(parts) > 1 else ""
    return ValueError(f"unknown {what}{plural} {', '.join(parts)}{hint}")



def known_keys(where: str, values: Any, valid: Iterable[str], what: str = "key") -> dict[str, Any]:
    """`values`, the mapping of section `where` ("" at the top), as a dict with only `valid` keys; else a one-line
    ValueError: the section is not a mapping, or each unknown key with the nearest valid one (`unknown {what} ...`)."""
    from collections.abc import Mapping

    valid = list(valid)
    if not isinstance(values, Mapping):
        raise ValueError(f"section {where!r} must be a mapping of {', '.join(valid)}")
    unknown = set(values) - set(valid)
    if unknown:
        prefix = f"{where}." if where else ""
        raise unknown_names(what, (prefix + k for k in unknown), (prefix + k for k in valid))
    return dict(values)
