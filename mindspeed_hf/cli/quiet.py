"""Third-party import noise, kept out of the command's output.

Importing the stack the command runs on makes other packages log warnings about this machine that no run of ours
can act on (bitsandbytes' "Failed to load CPU gemm_4bit_forward", DeepSpeed's "Setting accelerator to CPU").
`third_party_quiet` holds back warnings from any logger but ours, and Python warnings raised outside our package,
while the command imports them; errors always pass, and `--debug` or `--log_level` shows everything.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import warnings
from collections.abc import Iterator

OURS = "mindspeed_hf"
#: modules Trainer imports anyway on its first use (accelerate's unwrap_model imports deepspeed when installed):
#: imported here, inside the quiet block, so what they say about the machine at import stays out of the run's log
PRELOAD = ("deepspeed",)


def _ours(name: str) -> bool:
    return name == OURS or name.startswith(OURS + ".")


@contextlib.contextmanager
def third_party_quiet(enabled: bool = True) -> Iterator[list[logging.LogRecord]]:
    """While the block runs (imports): other packages' log records below ERROR and Python warnings raised outside
    mindspeed_hf are not shown; they are collected in the yielded list. `enabled=False` changes nothing."""
    hidden: list[logging.LogRecord] = []
    if not enabled:
        yield hidden
        return
    original = logging.Logger.handle

    def handle(logger: logging.Logger, record: logging.LogRecord) -> None:
        if record.levelno < logging.ERROR and not _ours(record.name):
            hidden.append(record)
            return
        original(logger, record)

    logging.Logger.handle = handle  # every logger, also those created by the imports themselves
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=rf"^(?!{OURS}\b)")
            yield hidden
    finally:
        logging.Logger.handle = original


def preload() -> None:
    """Import PRELOAD's modules that are installed (call inside third_party_quiet)."""
    for name in PRELOAD:
        if importlib.util.find_spec(name) is not None:
            with contextlib.suppress(Exception):  # a broken optional install is Trainer's to report, not ours
                importlib.import_module(name)


def wants_third_party_output(debug: bool, overrides: list[str]) -> bool:
    """--debug, or a TrainingArguments log level given on the command line (`--log_level info`), shows it all."""
    return debug or any(arg == "--log_level" or arg.startswith("--log_level=") for arg in overrides)
