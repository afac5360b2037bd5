"""`mindspeed-hf moe OUTPUT_DIR [--plot FILE.png]`: the expert load of a Trainer run on a MoE model, read from the
OUTPUT_DIR/moe_load.jsonl its logging intervals appended (moe/load.py). Prints one row per MoE layer (the
busiest expert's share over the mean, first and last interval and over the whole run, experts that never got a
token); --plot draws the heatmap of each layer's token share per expert over the run beside the imbalance of each
layer per logged step (matplotlib: the [plot] extra)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..bench.plot import require_matplotlib
from ..moe import ExpertLoad


def read_history(run_dir: str | Path) -> tuple[list[int | None], torch.Tensor]:
    """(steps, tokens [intervals, layers, experts]) of a run directory (or the .jsonl itself); one-line errors."""
    path = Path(run_dir)
    path = path / ExpertLoad.HISTORY if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no expert-load history here (a Trainer run on a MoE model with "
                                "moe.log_load on writes OUTPUT_DIR/moe_load.jsonl)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} is empty: no training loss was logged yet")
    return [row["step"] for row in rows], torch.tensor([row["tokens"] for row in rows], dtype=torch.float64)


def _imbalance(tokens: torch.Tensor) -> torch.Tensor:
    """Busiest expert over the mean, per row of [..., experts]."""
    return tokens.max(-1).values / tokens.mean(-1).clamp_min(1e-12)


def summary(run_dir: str | Path) -> str:
    """A markdown table: per MoE layer, the imbalance of the first and last interval and of the whole run, and the
    experts that got no token over the whole run."""
    steps, tokens = read_history(run_dir)
    per_step, total = _imbalance(tokens), tokens.sum(0)
    whole, never = _imbalance(total), (total == 0).sum(-1)
    lines = [f"expert load over {len(steps)} logged interval(s), steps {steps[0]}..{steps[-1]}; imbalance = "
             "busiest expert / mean", "", "| layer | first | last | whole run | experts never routed |",
             "|---|---|---|---|---|"]
    for layer in range(tokens.shape[1]):
        lines.append(f"| {layer} | {per_step[0, layer]:.3f} | {per_step[-1, layer]:.3f} | {whole[layer]:.3f} | "
                     f"{int(never[layer])} |")
    return "\n".join(lines)


def plot(run_dir: str | Path, out: str | Path) -> Path:
    """Heatmap of each layer's share of tokens per expert over the run, and each layer's imbalance per step."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, tokens = read_history(run_dir)
    total = tokens.sum(0)
    share = (total / total.sum(-1, keepdim=True).clamp_min(1)).numpy()
    fig, (heat, lines) = plt.subplots(1, 2, figsize=(14, 4.5))
    image = heat.imshow(share, aspect="auto", cmap="viridis")
    heat.set(xlabel="expert", ylabel="MoE layer", title="share of the layer's tokens per expert (whole run)")
    fig.colorbar(image, ax=heat)
    x = [s if s is not None else i for i, s in enumerate(steps)]
    for layer, values in enumerate(_imbalance(tokens).T.tolist()):
        lines.plot(x, values, label=f"layer {layer}")
    lines.axhline(1.0, color="grey", linewidth=1)
    lines.set(xlabel="step", ylabel="busiest expert / mean", title="imbalance per logged interval")
    if tokens.shape[1] <= 12:
        lines.legend(fontsize=7)
    fig.tight_layout()
    path = Path(out)
    os.makedirs(path.parent, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
