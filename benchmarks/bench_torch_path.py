"""The torch backend's choice, measured: HF's own code against ours, op by op, in whole training steps.

    taskset -c 1 python benchmarks/bench_torch_path.py --out benchmarks/results/torch_path_cpu.md

Under kernels.torch_path: auto a model on the torch backend runs HF's code for the ops where ours is slower there
(mindspeed_hf/patches/choice.py). This measures each op both ways against plain HF, in one process (the runs
alternating round by round, one thread): on the README's model and batches (tiny Qwen3, shared key/value heads,
padded rows, prompt tokens unlabelled) and on the tests' tiny Llama (4 x 64 tokens, no padding); then the loss alone
across vocabulary sizes (the SMALL_VOCAB threshold). "auto" is what `import mindspeed_hf` gives; "fused" runs ours
everywhere.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from ab_steps import PROCESS, alternating_steps, ratios
from results_io import emit

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ("rms_norm", "rope", "swiglu", "attention", "fused_linear_cross_entropy")


def _config(*on: str):
    """Ours for the kernels `on` only (kernels.torch_path: fused, so the choice does not hand any to HF)."""
    from mindspeed_hf.config import KernelConfig, MindSpeedConfig

    return MindSpeedConfig(kernels=KernelConfig(torch_path="fused", **{k: k in on for k in KERNELS}))


def _readme_model(vocab: int | None = None):
    """The README example's model and 8 batches of its data (or random ids of `vocab` with the same shape)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    from common import collate, load_tokenizer, read_rows, tiny_model, tokenized
    from transformers import Qwen3ForCausalLM

    tokenizer = load_tokenizer()
    rows = tokenized(read_rows(64), tokenizer, 32)
    batches = [collate(tokenizer.pad_token_id)(rows[i:i + 8]) for i in range(0, 64, 8)]
    if vocab is None:
        return (lambda: tiny_model(tokenizer, seed=0)), batches

    def build():
        model = tiny_model(tokenizer, seed=0)
        config = model.config
        config.vocab_size = vocab
        torch.manual_seed(0)
        return Qwen3ForCausalLM(config)

    generator = torch.Generator().manual_seed(1)
    for batch in batches:
        batch["input_ids"] = torch.randint(0, vocab, batch["input_ids"].shape, generator=generator)
        batch["labels"] = torch.where(batch["labels"] == -100, -100, batch["input_ids"])
    return build, batches


def _llama():
    import torch
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import VOCAB, tiny_model

    ids = torch.randint(2, VOCAB, (4, 64), generator=torch.Generator().manual_seed(1))
    return (lambda: tiny_model("llama")), [{"input_ids": ids, "labels": ids}]


def _row(label: str, phases: dict, losses: dict, ran: dict, name: str) -> str:
    per_round = ratios(phases, name)
    diff = max(abs(a - b) for a, b in zip(losses["plain HF"], losses[name], strict=True))
    step = statistics.median(p[2] for p in phases[name]) * 1e3
    return (f"| {label} | {name} | {step:.2f} | {statistics.median(per_round):.3f}x [{per_round[0]:.3f}-"
            f"{per_round[-1]:.3f}] | {diff:.1e} | {', '.join(ran.get(name, {})) or '-'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24, help="timed steps per run and round")
    ap.add_argument("--vocabs", default="128,1024,4096,8192,32000", help="vocabulary sizes of the loss sweep")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("MINDSPEED_HF_AUTO", "0")  # enabled by hand (ab_steps)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(1)
    header = ["| model | run | step (ms) | vs plain HF per round, median [min-max] | max loss diff | ran (ours) |",
              "|---|---|---|---|---|---|"]
    lines = [f"`taskset -c N python benchmarks/bench_torch_path.py {' '.join(sys.argv[1:])}`", "",
             f"Backend torch (CPU), fp32, one thread, affinity {sorted(os.sched_getaffinity(0))}; {args.rounds} "
             f"rounds of {args.steps} steps (forward with labels, backward, AdamW), the runs alternating in one "
             "process; step = median of a round's steps after 3, median over rounds.", "",
             "Each op both ways: `auto` is the default (HF's code for the ops choice.py hands over), `fused` ours "
             "everywhere, `only X` ours for X alone (every other op HF's):", "", *header]
    variants = {"plain HF": None, "auto": PROCESS, "fused": _config(*KERNELS),
                **{f"only {k}": _config(k) for k in KERNELS}}
    for label, (build, batches) in (("README Qwen3 (8 x 32, padded)", _readme_model()),
                                    ("tests' Llama (4 x 64)", _llama())):
        phases, losses, ran = alternating_steps(build, batches, variants, args.rounds, args.steps)
        lines += [_row(label, phases, losses, ran, name) for name in variants if name != "plain HF"]
    lines += ["", "The loss alone across vocabulary sizes (README's model and batch shapes, random ids; ours for the "
              "loss only, against plain HF):", "", *header]
    for vocab in (int(v) for v in args.vocabs.split(",")):
        build, batches = _readme_model(vocab)
        loss_only = {"plain HF": None, "auto": PROCESS, "only fused_linear_cross_entropy":
                     _config("fused_linear_cross_entropy")}
        phases, losses, ran = alternating_steps(build, batches, loss_only, args.rounds, args.steps)
        lines += [_row(f"vocabulary {vocab}", phases, losses, ran, name) for name in loss_only if name != "plain HF"]
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
