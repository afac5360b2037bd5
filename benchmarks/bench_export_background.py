"""What `checkpoints: {export_hf: true}` costs a training run: the same Trainer run with checkpoints every few steps,
without and with the background export, in separate processes, interleaved.

    python benchmarks/bench_export_background.py [--steps 24] [--save-steps 6] [--rounds 3]
                                                 [--out benchmarks/results/export_background_cpu.md]

Reports the median training step (forward + backward + optimizer, Trainer's on_step_begin -> on_step_end, so the
checkpoint writing itself is not in it), the whole train() (saves and the waits for exports included) and the
exports written, each side's median over the rounds, and the ratios with their spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(args) -> None:
    """One Trainer run (a Qwen3-shaped model of `--hidden` / `--layers`); prints its timings as JSON."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Trainer, TrainerCallback, TrainingArguments

    import mindspeed_hf

    mindspeed_hf.enable()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                         head_dim=args.hidden // 8))
    rows = torch.randint(1, 32000, (args.steps * 4, 128), generator=torch.Generator().manual_seed(0)).tolist()
    steps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            steps.append(time.perf_counter() - self.start)

    out = os.path.join(args.dir, "run")
    targs = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=4,
                              save_steps=args.save_steps, report_to="none", disable_tqdm=True, use_cpu=True,
                              logging_strategy="no")
    trainer = Trainer(model=model, args=targs, train_dataset=[{"input_ids": r, "labels": r} for r in rows],
                      callbacks=[Clock()])
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    exports = len(os.listdir(os.path.join(out, "hf"))) if os.path.isdir(os.path.join(out, "hf")) else 0
    print(json.dumps({"step": statistics.median(steps[1:]), "train": total, "exports": exports,
                      "params": sum(p.numel() for p in model.parameters())}))


def run(args, export_hf: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "MINDSPEED_HF_AUTO": "0", "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error",
               "MINDSPEED_HF_CHECKPOINTS_EXPORT_HF": "1" if export_hf else "0",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, __file__, "--worker", "--dir", tmp, "--steps", str(args.steps), "--save-steps",
               str(args.save_steps), "--hidden", str(args.hidden), "--layers", str(args.layers)]
        proc = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--save-steps", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results_io import emit, spread

    pairs = []
    for i in range(args.rounds):  # alternate which side goes first
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {flag: run(args, flag) for flag in order}
        pairs.append((got[False], got[True]))
    plain, ours = [p[0] for p in pairs], [p[1] for p in pairs]

    def med(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    lines = [f"Qwen3-shaped model ({plain[0]['params'] / 1e6:.0f}M parameters, fp32, hidden {args.hidden}, "
             f"{args.layers} layers), plain Trainer with mindspeed_hf on, batch 4 x 128, {args.steps} steps, a "
             f"checkpoint every {args.save_steps}; without and with `checkpoints: {{export_hf: true}}`, separate "
             f"processes, {args.rounds} interleaved rounds, 2-core CPU (the export shares the cores)",
             "", "| | step (s, median) | train() (s, median) | exports written |", "|---|---|---|---|",
             f"| export_hf off | {med(plain, 'step'):.3f} | {med(plain, 'train'):.1f} | {plain[0]['exports']} |",
             f"| export_hf on | {med(ours, 'step'):.3f} | {med(ours, 'train'):.1f} | {ours[0]['exports']} |",
             f"| ratio on / off | {spread([b['step'] / a['step'] for a, b in pairs])} | "
             f"{spread([b['train'] / a['train'] for a, b in pairs])} | |"]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
