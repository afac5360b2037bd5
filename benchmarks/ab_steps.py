"""Plain Hugging Face against mindspeed_hf in ONE process: the same tiny model (one copy per run, from one seed),
whole training steps (forward with labels, backward, AdamW), the runs alternating round by round with mindspeed_hf
disabled and enabled between them. One process takes the process-to-process spread (+-10% per pair on a shared
machine) out of the comparison. Needs MINDSPEED_HF_AUTO=0 at import (enabled by hand here) and the tests folder on
sys.path (tests/tiny_models.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

RUNS = ("plain HF", "mindspeed_hf")
CONTROL = "plain HF again"  # a second plain run: the ratio two identical runs give is the comparison's resolution
PROCESS = "process config"  # a run under the process config (what `import mindspeed_hf` gives a user)


def alternating_steps(build: Callable, batches: list[dict], configs: dict, rounds: int, steps: int
                      ) -> tuple[dict, dict, dict]:
    """Runs named by `configs` ({name: None for plain HF, PROCESS, or a MindSpeedConfig}), alternating round by
    round (in `configs`' order, then reversed: no run always follows the same one), `steps` steps each (the batches
    in turn), each round on fresh copies of `build()` (a copy kept for every round would keep its place in memory,
    which alone made one of two identical runs up to 4% slower than the other over 12 rounds). Returns ({name:
    [(forward, backward, step) seconds, median over the steps after 3, one tuple per round]}, {name: the first
    round's losses}, {name: what report() said ran in its first round})."""
    import torch

    import mindspeed_hf

    phases: dict[str, list[tuple[float, float, float]]] = {name: [] for name in configs}
    losses: dict[str, list[float]] = {}
    ran: dict[str, dict[str, int]] = {}
    for round_ in range(rounds):
        runs = {}
        for name in configs:
            model = build().train()
            runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        for name in (list(configs) if round_ % 2 == 0 else list(reversed(configs))):
            config = configs[name]
            model, optimizer = runs[name]
            if config is not None:
                mindspeed_hf.enable()
                mindspeed_hf.apply_to_model(model, None if config == PROCESS else config)
            fwd, bwd, whole, seen = [], [], [], []
            for step in range(steps):
                batch = batches[step % len(batches)]
                start = time.perf_counter()
                loss = model(**batch).loss
                mid = time.perf_counter()
                loss.backward()
                end = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                fwd.append(mid - start), bwd.append(end - mid), whole.append(time.perf_counter() - start)
                seen.append(loss.item())
            if config is not None:
                ran.setdefault(name, {op: n for op, n in mindspeed_hf.report(model)["ran"].items() if n})
                mindspeed_hf.disable()
            losses.setdefault(name, seen)
            phases[name].append(tuple(statistics.median(x[3:]) for x in (fwd, bwd, whole)))
    return phases, losses, ran


def step_phases(family: str, shape: tuple[int, int], rounds: int, steps: int, control: bool = False
                ) -> tuple[dict, dict, dict]:
    """Plain HF against mindspeed_hf under the process config on the tiny `family` model, `shape` tokens (labels =
    the inputs), with a second plain run (CONTROL) where `control`: ({run: per-round (forward, backward, step)
    medians}, {run: losses}, what ran in mindspeed_hf)."""
    import torch
    from tiny_models import VOCAB, tiny_model

    ids = torch.randint(2, VOCAB, shape, generator=torch.Generator().manual_seed(1))
    phases, losses, ran = alternating_steps(lambda: tiny_model(family), [{"input_ids": ids, "labels": ids}],
                                            {RUNS[0]: None, RUNS[1]: PROCESS, **({CONTROL: None} if control else {})},
                                            rounds, steps)
    return phases, losses, ran.get(RUNS[1], {})


def ratios(phases: dict, name: str = RUNS[1]) -> list[float]:
    """Run `name`'s step over plain HF's, per round, sorted."""
    return sorted(a[2] / p[2] for p, a in zip(phases[RUNS[0]], phases[name], strict=True))
