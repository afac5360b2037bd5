"""Kernels dispatched per training step (forward + backward + gradient clipping + AdamW step) of diffusers'
denoisers, plain diffusers vs mindspeed_hf, for the tiny config of every family (tests/tiny_denoisers.py: the same
models and flow-matching / epsilon losses the parity tests use), with the counting code `mindspeed-hf bench` uses
(mindspeed_hf/bench/counts.py). Counts, not timings: the same code gives the same table on any machine.

    python benchmarks/bench_diffusion_counts.py --out benchmarks/results/diffusion_op_counts.md

Two accelerated columns: the torch backend (the reference kernels: the same math as diffusers, so no reduction is
expected) and the npu backend, where each torch_npu call (and its backward) is one kernel. Without a real torch_npu
the npu column runs through the stand-in in tests/npu_standin.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tiny denoisers
os.environ["MINDSPEED_HF_AUTO"] = "0"  # import without patching: each accelerated model is settled on its own

from results_io import emit  # noqa: E402  (benchmarks/, beside this script)

import mindspeed_hf  # noqa: E402
from mindspeed_hf.bench.counts import count_step, measure_saved  # noqa: E402
from mindspeed_hf.config import config_from_dict  # noqa: E402
from mindspeed_hf.device import import_torch_npu  # noqa: E402

if import_torch_npu() is None:  # no real torch_npu here: the npu column goes through the stand-in
    sys.path.insert(0, str(ROOT / "tests" / "npu_standin"))
    import_torch_npu.cache_clear()

from tiny_denoisers import FAMILIES, loss_of, noisy_batch  # noqa: E402


def counts_for(family: str, backend: str | None) -> dict:
    """Counts of one training step of `family`'s tiny model (after one uncounted step that creates the AdamW
    state): plain diffusers (backend None) or accelerated on `backend`; then the bytes saved for backward."""
    tiny = FAMILIES[family]()
    if backend is not None:
        mindspeed_hf.enable(config_from_dict({"backend": backend}))
        mindspeed_hf.apply_to_model(tiny.model)
    try:
        batch = noisy_batch(tiny)
        optimizer = torch.optim.AdamW(tiny.model.parameters(), lr=1e-4, fused=True)

        def step() -> None:
            loss_of(tiny, batch).backward()
            torch.nn.utils.clip_grad_norm_(tiny.model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()
        with count_step(tiny.model) as counts:
            step()
        with measure_saved(tiny.model, counts):
            step()
        return counts
    finally:
        mindspeed_hf.disable()


def _kernels(counts: dict) -> int:
    return counts["aten_ops"] + counts["npu_calls"]


def table(families: list[str]) -> str:
    lines = ["| family | plain diffusers | mindspeed_hf, torch backend (ratio) | mindspeed_hf, npu backend (ratio) | "
             "torch_npu calls (fwd + bwd) | of which | saved for backward, npu vs plain |", "|---" * 7 + "|"]
    for family in families:
        plain, fast, npu = (counts_for(family, backend) for backend in (None, "torch", "npu"))
        by_op = ", ".join(f"{op} {n}" for op, n in npu["npu_by_op"].items())
        saved = f"{npu['saved_bytes'] / plain['saved_bytes']:.2f}x" if plain["saved_bytes"] else "n/a"
        lines.append(f"| {family} | {_kernels(plain):,} | {_kernels(fast):,} ({_kernels(fast) / _kernels(plain):.2f}x)"
                     f" | {_kernels(npu):,} ({_kernels(npu) / _kernels(plain):.2f}x) | {npu['npu_calls']} | {by_op} |"
                     f" {saved} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, from: {', '.join(FAMILIES)}")
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = parser.parse_args(argv)
    families = args.families.split(",")
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"--families: unknown {', '.join(unknown)}; choose from {', '.join(FAMILIES)}")
    npu = "real torch_npu" if "npu_standin" not in str(getattr(import_torch_npu(), "__file__", "")) else "stand-in"
    import diffusers

    text = (f"## diffusers denoisers: kernels dispatched per training step (forward + backward + gradient clipping + "
            f"fused AdamW), tiny configs of tests/tiny_denoisers.py, fp32\n\n"
            f"`python benchmarks/bench_diffusion_counts.py` (torch {torch.__version__}, diffusers "
            f"{diffusers.__version__}; npu backend through the {npu}). Kernels = aten operators outside torch_npu "
            f"calls + torch_npu calls (each call and its backward one kernel).\n\n{table(families)}\n")
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
