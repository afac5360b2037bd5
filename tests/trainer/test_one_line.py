"""One line per mistake, whatever launched the program (mindspeed_hf/errors.py): a mistake found while a Trainer or
an Accelerator is built names the setting, its real source (YAML, variable, argument) and the valid choices, and if
nobody catches it prints once (rank 0) as one line, every rank exiting 1 without a traceback (the traceback with
MINDSPEED_HF_LOG_LEVEL=DEBUG); the process switches and the command's numbers are checked. (Under torchrun, end to
end: tests/distributed/test_faults.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import mindspeed_hf
from mindspeed_hf import errors
from mindspeed_hf.cli.main import main as command

sys.path.insert(0, str(Path(__file__).parent))
from crash_driver import collate, dataset, tiny_model  # noqa: E402


# ---------------------------------------------------------------------------------------------- the hook
def _hooked(monkeypatch, rank: str) -> list[tuple]:
    """Install errors.py's hook over a recording one; returns what reached the recording hook."""
    reached: list[tuple] = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: reached.append(a))
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(errors.time, "sleep", lambda s: None)
    return reached


@pytest.mark.parametrize("rank,every_rank,expected", [
    ("0", False, "mindspeed_hf: error: a b (MINDSPEED_HF_LOG_LEVEL=DEBUG shows the traceback)\n"),
    ("1", False, ""),  # every rank finds the same mistake: rank 0 says it
    ("1", True, "mindspeed_hf (rank 1): error: a b (MINDSPEED_HF_LOG_LEVEL=DEBUG shows the traceback)\n"),
])
def test_an_uncaught_mistake_is_one_line_from_one_rank(monkeypatch, capsys, rank, every_rank, expected):
    reached = _hooked(monkeypatch, rank)
    err = errors.say_once_if_uncaught(ValueError("a\n  b"), every_rank=every_rank)
    sys.excepthook(ValueError, err, None)
    assert capsys.readouterr().err == expected and not reached


def test_other_errors_and_debug_keep_the_traceback(monkeypatch, capsys):
    reached = _hooked(monkeypatch, "0")
    marked = errors.say_once_if_uncaught(ValueError("mine"))
    other = RuntimeError("not ours")
    sys.excepthook(RuntimeError, other, None)
    monkeypatch.setenv("MINDSPEED_HF_LOG_LEVEL", "debug")
    sys.excepthook(ValueError, marked, None)
    assert [a[1] for a in reached] == [other, marked] and capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------- where they come from
def _trainer(**mindspeed):
    from transformers import Trainer, TrainingArguments

    common = dict(output_dir="unused", use_cpu=True, report_to="none")
    args = mindspeed_hf.MindSpeedTrainingArguments(**common, **mindspeed) if mindspeed else TrainingArguments(**common)
    return Trainer(model=tiny_model(), args=args, train_dataset=dataset(), data_collator=collate)


@pytest.mark.parametrize("source", ["yaml", "variable", "argument"])
def test_a_trainer_mistake_names_its_real_source(tmp_path, monkeypatch, restore_wiring, source):
    monkeypatch.chdir(tmp_path)
    if source == "yaml":
        (tmp_path / "accel.yaml").write_text("parallel:\n  tp: 3\n")
        monkeypatch.setenv("MINDSPEED_HF_CONFIG", str(tmp_path / "accel.yaml"))
        named = "parallel.tp=3 (config file "
    elif source == "variable":
        monkeypatch.setenv("MINDSPEED_HF_PARALLEL_TP", "3")
        named = "MINDSPEED_HF_PARALLEL_TP=3 (environment (MINDSPEED_HF_*))"
    else:
        named = "mindspeed_tp=3 (training arguments (mindspeed_*))"
    mindspeed_hf.enable()
    with pytest.raises(ValueError) as caught:
        _trainer(**({"mindspeed_tp": 3} if source == "argument" else {}))
    text = str(caught.value)
    assert f"mindspeed_hf parallel sizes from {named}" in text and "valid choices" in text, text
    assert caught.value._mindspeed_one_line == "rank 0"


def test_an_accelerator_mistake_is_marked_too(monkeypatch, restore_wiring):
    from accelerate import Accelerator

    monkeypatch.setenv("MINDSPEED_HF_PARALLEL_TP", "3")
    mindspeed_hf.enable()
    with pytest.raises(ValueError, match="MINDSPEED_HF_PARALLEL_TP=3") as caught:
        Accelerator(cpu=True)
    assert caught.value._mindspeed_one_line == "rank 0"


# ---------------------------------------------------------------------------------------------- switches and numbers
@pytest.mark.parametrize("env,argv,fragment", [
    ({"MINDSPEED_HF_AUTO": "maybe"}, ["env"], "MINDSPEED_HF_AUTO='maybe' must be true or false"),
    ({"MINDSPEED_HF_LOG_LEVEL": "loud"}, ["env"], "MINDSPEED_HF_LOG_LEVEL='loud' is not valid; choose one of debug, "
                                                  "info, warning, error, critical"),
    ({"MINDSPEED_HF_LOG_LEVEL": "loud"}, ["bench"], "MINDSPEED_HF_LOG_LEVEL='loud' is not valid"),
    ({}, ["bench", "--steps", "0"], "mindspeed-hf bench: error: --steps=0 must be >= 1"),
    ({}, ["bench", "--steps", "many"], "mindspeed-hf bench: error: argument --steps: invalid int value: 'many'"),
    ({}, ["bench", "--repeats", "0"], "--repeats=0 must be >= 1"),
    ({}, ["export", "only-one"], "mindspeed-hf export: error: the following arguments are required: OUT"),
], ids=["auto", "log-level-env", "log-level-bench", "bench-steps-zero", "bench-steps-word", "bench-repeats",
        "export-missing-out"])
def test_switches_and_numbers_are_checked(monkeypatch, capsys, restore_wiring, env, argv, fragment):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    mindspeed_hf.disable()
    try:
        rc = command(argv)
    except SystemExit as exit_:  # argparse's own mistakes: the command's one line, exit status 2
        rc = exit_.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert rc == 2 and len(lines) == 1 and fragment in lines[0], err
    assert "Traceback" not in err and "usage:" not in err


def test_import_with_a_bad_switch_is_one_line(monkeypatch):
    monkeypatch.setenv("MINDSPEED_HF_AUTO", "maybe")
    with pytest.raises(ValueError, match="MINDSPEED_HF_AUTO='maybe'") as caught:
        mindspeed_hf.auto_enable()
    assert caught.value._mindspeed_one_line == "rank 0" and not mindspeed_hf.is_enabled()
