"""`mindspeed-hf bench --plot FILE.png`: the per-step loss of both runs overlaid (first pair), and the ratio of
each figure with its spread over the pairs as error bars, one chart to paste into an issue or a report.
matplotlib is an optional extra (`pip install 'mindspeed_hf[plot]'`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .run import FIGURES, PROXIES, RUNS, proxy_value, ratio_stats


def matplotlib_available() -> bool:
    """True when matplotlib imports here."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def require_matplotlib() -> None:
    """Fail with one line naming the extra when matplotlib is missing."""
    if not matplotlib_available():
        raise ImportError("--plot needs matplotlib: pip install 'mindspeed_hf[plot]'")


def plot(bases: list[dict[str, Any]], fasts: list[dict[str, Any]], path: str | Path,
         counts: dict[str, dict[str, Any]] | None = None) -> Path:
    """Draw the chart into `path` (format from its suffix, e.g. .png); returns the path. With `counts` (bench's
    counted step of each side), a third panel: the ratios of the per-step proxies."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if counts else 2, figsize=(16 if counts else 11, 4.5))
    losses, ratios = axes[0], axes[1]
    for (label, _), run in zip(RUNS, (bases[0], fasts[0]), strict=True):
        steps = sorted(run["losses"], key=int)
        losses.plot([int(s) for s in steps], [run["losses"][s] for s in steps], label=label,
                    linestyle="-" if run is bases[0] else "--")
    losses.set(xlabel="step", ylabel="training loss", title=f"loss per step ({fasts[0]['model_type']})")
    losses.legend()
    names = [n for n in FIGURES if ratio_stats(n, bases, fasts) is not None]
    stats = [ratio_stats(n, bases, fasts) for n in names]
    medians = [s[0] for s in stats]
    errors = [[s[0] - s[1] for s in stats], [s[2] - s[0] for s in stats]]
    ratios.bar(range(len(names)), medians, yerr=errors, capsize=6, color="tab:blue")
    ratios.axhline(1.0, color="grey", linewidth=1)
    ratios.set_xticks(range(len(names)), names, rotation=15)
    ratios.set(ylabel=f"{RUNS[1][0]} / baseline", title=f"median ratio, min..max over {len(bases)} pair(s)")
    if counts:
        names = [n for n in PROXIES if proxy_value(counts["baseline"], n)]
        values = [proxy_value(counts["accelerated"], n) / proxy_value(counts["baseline"], n) for n in names]
        axes[2].bar(range(len(names)), values, color="tab:green")
        axes[2].axhline(1.0, color="grey", linewidth=1)
        axes[2].set_xticks(range(len(names)), [n.split(" (")[0] for n in names], rotation=15, fontsize=8)
        axes[2].set(ylabel=f"{RUNS[1][0]} / baseline", title="counted per step (deterministic)")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
