"""Plain Hugging Face against mindspeed_hf in ONE process: the same tiny model (two copies from one seed), whole
training steps (forward with labels, backward, AdamW), the two runs alternating round by round with mindspeed_hf
disabled and enabled between them. One process takes the process-to-process spread (+-10% per pair on a shared
machine) out of the comparison. Needs MINDSPEED_HF_AUTO=0 at import (enabled by hand here) and the tests folder on
sys.path (tests/tiny_models.py)."""

from __future__ import annotations

import statistics
import time

RUNS = ("plain HF", "mindspeed_hf")


def step_phases(family: str, shape: tuple[int, int], rounds: int, steps: int) -> tuple[dict, dict, dict]:
    """({run: [(forward, backward, step) seconds, median over `steps` after 3, one tuple per round]},
    {run: the first round's losses}, what report() said ran in mindspeed_hf's first round)."""
    import torch
    from tiny_models import VOCAB, tiny_model

    import mindspeed_hf

    ids = torch.randint(2, VOCAB, shape, generator=torch.Generator().manual_seed(1))
    runs = {}
    for name in RUNS:
        model = tiny_model(family).train()
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    phases: dict[str, list[tuple[float, float, float]]] = {name: [] for name in RUNS}
    losses: dict[str, list[float]] = {}
    ran: dict[str, int] = {}
    for _ in range(rounds):
        for name, (model, optimizer) in runs.items():
            if name == "mindspeed_hf":
                mindspeed_hf.enable()
                mindspeed_hf.apply_to_model(model)
            fwd, bwd, whole, seen = [], [], [], []
            for _ in range(steps):
                start = time.perf_counter()
                loss = model(input_ids=ids, labels=ids).loss
                mid = time.perf_counter()
                loss.backward()
                end = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                fwd.append(mid - start), bwd.append(end - mid), whole.append(time.perf_counter() - start)
                seen.append(loss.item())
            if name == "mindspeed_hf":
                ran = ran or dict(mindspeed_hf.report(model)["ran"])
                mindspeed_hf.disable()
            losses.setdefault(name, seen)
            phases[name].append(tuple(statistics.median(x[3:]) for x in (fwd, bwd, whole)))
    return phases, losses, ran


def ratios(phases: dict) -> list[float]:
    """mindspeed_hf's step over plain HF's, per round, sorted."""
    return sorted(a[2] / p[2] for p, a in zip(phases["plain HF"], phases["mindspeed_hf"], strict=True))
