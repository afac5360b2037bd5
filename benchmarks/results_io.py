"""What the benchmark scripts share: print a result and write it where --out says."""

from __future__ import annotations

from pathlib import Path


def emit(text: str, out: str | None) -> None:
    """Print `text` (markdown) and, with `out`, write it there (creating the folder)."""
    print(text, flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
