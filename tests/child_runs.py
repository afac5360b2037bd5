"""Child runs of the tests (example scripts, the CLI, torchrun workers): one child environment, one torchrun
command line, one failure message with the output's tail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Settings a developer's shell may carry that would change what a child run does.
FOREIGN = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_", "MINDSPEED_HF_")


def child_env(auto: bool = False, quiet: bool = True, **extra: str) -> dict[str, str]:
    """This environment without FOREIGN settings and with the repo importable; kernels on only with `auto`, ours
    everywhere on the CPU when on (kernels.torch_path: fused: the tests compare them with HF's); one thread per
    process (tiny models on 2 shared cores: faster and deterministic); `quiet` silences transformers' and Python's
    warnings (tests that read warnings keep them)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(FOREIGN)}
    env.update(MINDSPEED_HF_AUTO="1" if auto else "0", MINDSPEED_HF_KERNELS_TORCH_PATH="fused", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    if quiet:
        env.update(TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def torchrun(*args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


def run_or_fail(cmd: list[str], env: dict[str, str], what: str, timeout: int = 500) -> None:
    import pytest

    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{what} failed, rc={proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")


def run_worker(worker: Path, out: Path, *args: str, nproc: int = 2, env: dict[str, str] | None = None) -> dict:
    """`worker *args --out OUT` under torchrun with `nproc` ranks (0: one plain process); returns the JSON it wrote."""
    cmd = [str(worker), *args, "--out", str(out)]
    launch = torchrun(*cmd, nproc=nproc) if nproc else [sys.executable, *cmd]
    run_or_fail(launch, child_env() if env is None else env, f"{worker.name} {' '.join(args)} (nproc={nproc})")
    return json.loads(out.read_text())


# The plain-HF references of this test session by (worker, arguments): the same deterministic run is made once
# (test_tensor_parallel and test_export_runs ask for the same few, some of them for every parametrized case).
_REFERENCES: dict[tuple[str, ...], dict] = {}


def run_trainer_worker(worker: Path, root: Path, name: str, *args: str, config: str | None = None,
                       nproc: int = 2) -> dict:
    """A plain-Trainer worker: with `config` None the single-process plain-HF reference (mindspeed_hf not imported;
    made once per session for the same worker and arguments), else under torchrun with `nproc` ranks and the sizes
    only from MINDSPEED_HF_CONFIG (`config`, YAML text). Returns the JSON it wrote, with "params" (the .pt it saved
    beside it) and "saved" (its save_model directory)."""
    out = root / f"{name}.json"
    cmd = [str(worker), *args, "--out", str(out)]
    if config is None:
        key = (str(worker), *args)
        if key not in _REFERENCES:
            run_or_fail([sys.executable, *cmd], child_env(), name)
            _REFERENCES[key] = _result(out)
        return dict(_REFERENCES[key])
    (root / f"{name}.yaml").write_text(config)
    run_or_fail(torchrun(*cmd, nproc=nproc), child_env(auto=True, MINDSPEED_HF_CONFIG=str(root / f"{name}.yaml")),
                name)
    return _result(out)


def _result(out: Path) -> dict:
    """What a trainer worker wrote: its JSON, "params" (the .pt beside it) and "saved" (its save_model directory)."""
    import torch

    return {**json.loads(out.read_text()), "params": torch.load(str(out) + ".pt"), "saved": str(out) + ".saved"}


def assert_trained_alike(run: dict, want: dict, tol: float, steps: int = 3) -> None:
    """Two run_trainer_worker results trained alike: `steps` logged losses and grad norms, and every parameter
    after them, within `tol`."""
    for key in ("losses", "grad_norms"):
        assert len(run[key]) == len(want[key]) == steps, (key, run[key], want[key])
        assert max(abs(a - b) for a, b in zip(run[key], want[key])) <= tol, (key, run[key], want[key])
    assert run["params"].keys() == want["params"].keys()
    worst = max((run["params"][n] - want["params"][n]).abs().max().item() for n in want["params"])
    assert worst <= tol, worst
