"""Helpers for the trainer tests: run example scripts and the `mindspeed-hf` command in subprocesses (the
accelerator patches at import, so "with" and "without" must be separate processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from child_runs import REPO, child_env

import mindspeed_hf

EXAMPLES = REPO / "examples"


def run(cmd: list[str], auto: bool, cwd: Path | None = None, check: bool = True,
        **extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=child_env(auto, quiet=False, **extra), cwd=cwd or REPO, capture_output=True,
                          text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def run_example(script: str, tmp_path: Path, auto: bool, *args: str) -> list[dict]:
    """Run examples/<script> and return its JSON lines (per-step losses, then the report)."""
    out = tmp_path / f"{Path(script).stem}_{int(auto)}.jsonl"
    run([sys.executable, str(EXAMPLES / script), "--output_dir", str(tmp_path / "out"), "--losses_file", str(out),
         *args], auto=auto)
    return [json.loads(line) for line in out.read_text().splitlines()]


def cli(args: list[str], auto: bool = True, check: bool = True, **extra: str) -> subprocess.CompletedProcess:
    """`mindspeed-hf ARGS` in a subprocess."""
    return run([sys.executable, "-m", "mindspeed_hf.cli.main", *args], auto=auto, check=check, **extra)


@pytest.fixture
def restore_wiring():
    """Leave the package as the test found it (tests/conftest.py disables it after each test as well)."""
    from mindspeed_hf.trainers import wiring

    was = mindspeed_hf.is_enabled(), wiring.is_installed()
    yield
    mindspeed_hf.disable()
    wiring.uninstall_trainer_wiring()
    if was[0]:
        mindspeed_hf.enable()
    elif was[1]:
        wiring.install_trainer_wiring()
