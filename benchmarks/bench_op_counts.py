"""Operators dispatched per training step (forward + backward + AdamW step), plain Hugging Face vs mindspeed_hf, for
the tiny config of every family (tests/tiny_models.py), with the counting code `mindspeed-hf bench` uses
(mindspeed_hf/bench/counts.py). Counts, not timings: the same code gives the same table on any machine.

The optimizer is the one Trainer builds by default on both sides (`optim="adamw_torch_fused"` on every supported
transformers release with torch >= 2.8): torch.optim.AdamW(fused=True) over Trainer's two parameter groups (with and
without weight decay), i.e. one `_fused_adamw_` kernel per group, on the CPU as on an NPU (torch_npu registers
`_fused_adamw_` for its device).

    python benchmarks/bench_op_counts.py --out benchmarks/results/op_counts.md

Two accelerated columns: the torch backend (the CPU reference kernels: the same math as HF, so no reduction is
expected) and the npu backend, where each torch_npu call (and its backward) is one kernel. Without a real
torch_npu the npu column runs through the stand-in in tests/npu_standin (exact reference math, strict schemas).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tiny family configs
os.environ["MINDSPEED_HF_AUTO"] = "0"  # import without patching: each accelerated model is patched on its own

from results_io import emit  # noqa: E402  (benchmarks/, beside this script)
from tiny_models import FAMILY_CONFIGS, VOCAB, tiny_model  # noqa: E402

import mindspeed_hf  # noqa: E402
from mindspeed_hf.bench.counts import count_model_step  # noqa: E402
from mindspeed_hf.config import config_from_dict  # noqa: E402
from mindspeed_hf.device import import_torch_npu  # noqa: E402

DEFAULT_FAMILIES = ("llama", "qwen3", "qwen3_moe", "gemma2")


def _batch(batch: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def trainer_default_adamw(model: torch.nn.Module, lr: float = 1e-3) -> torch.optim.Optimizer:
    """Trainer's default optimizer: fused AdamW over its two groups (decay: the matrices; no decay: the 1-D norm and
    bias parameters; TrainingArguments' default weight_decay is 0.0 for both)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.0},
              {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, fused=True)


def count_trainer_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict:
    """count_model_step of one training step as Trainer runs it: gradient clipping at 1.0 and Trainer's default
    fused AdamW."""
    return count_model_step(model, batch, optimizer=trainer_default_adamw(model), max_grad_norm=1.0)


def counts_for(family: str, backend: str | None, batch: dict[str, torch.Tensor]) -> dict:
    """Counts of one step of `family`'s tiny model: plain HF (backend None) or accelerated on `backend`."""
    model = tiny_model(family).train()
    if backend is None:
        return count_trainer_step(model, batch)
    mindspeed_hf.enable()
    try:
        mindspeed_hf.apply_to_model(model, config_from_dict({"backend": backend}))
        return count_trainer_step(model, batch)
    finally:
        mindspeed_hf.disable()


def _kernels(counts: dict) -> int:
    return counts["aten_ops"] + counts["npu_calls"]


def table(families: list[str], backends: list[str], batch: dict[str, torch.Tensor]) -> str:
    """One row per family: kernels dispatched per step, plain HF and each backend, with the ratio to plain HF;
    the torch_npu calls of the npu backend; bytes saved for backward on the torch backend vs plain HF."""
    header = "| family | plain HF | " + " | ".join(f"mindspeed_hf, {b} backend (ratio)" for b in backends)
    lines = [header + " | torch_npu calls (fwd + bwd) | saved for backward, torch backend vs plain |",
             "|---" * (4 + len(backends)) + "|"]
    for family in families:
        plain = counts_for(family, None, batch)
        runs = {backend: counts_for(family, backend, batch) for backend in backends}
        cells = [f"{_kernels(plain):,}"]
        cells += [f"{_kernels(c):,} ({_kernels(c) / _kernels(plain):.2f}x)" for c in runs.values()]
        npu = runs.get("npu", {}).get("npu_calls", "n/a")
        torch_saved = runs.get("torch", {}).get("saved_bytes")
        saved = f"{torch_saved / plain['saved_bytes']:.2f}x" if torch_saved and plain["saved_bytes"] else "n/a"
        lines.append(f"| {family} | " + " | ".join(cells) + f" | {npu} | {saved} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(DEFAULT_FAMILIES),
                        help=f"comma-separated, from: {', '.join(sorted(FAMILY_CONFIGS))}; or 'all'")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = parser.parse_args(argv)
    families = sorted(FAMILY_CONFIGS) if args.families == "all" else args.families.split(",")
    unknown = sorted(set(families) - set(FAMILY_CONFIGS))
    if unknown:
        parser.error(f"--families: unknown {', '.join(unknown)}; choose from {', '.join(sorted(FAMILY_CONFIGS))}")
    if import_torch_npu() is None:  # no real torch_npu here: the npu column goes through the stand-in
        sys.path.insert(0, str(ROOT / "tests" / "npu_standin"))
        import_torch_npu.cache_clear()
    npu = "real torch_npu" if "npu_standin" not in str(getattr(import_torch_npu(), "__file__", "")) else "stand-in"
    body = table(families, ["torch", "npu"], _batch(args.batch, args.seq))
    text = (f"## Kernels dispatched per training step (forward + backward + gradient clipping + Trainer's default "
            f"fused AdamW), tiny configs, batch {args.batch} x {args.seq}, fp32\n\n"
            f"`python benchmarks/bench_op_counts.py` (torch {torch.__version__}; npu backend through the {npu}). "
            f"Kernels = aten operators outside torch_npu calls + torch_npu calls (each call and its backward one "
            f"kernel). The optimizer step is one `_fused_adamw_` per parameter group on both sides.\n\n{body}\n")
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
