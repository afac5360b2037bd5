"""Activation memory and step time of one training step: recompute none / selective / full, side by side.

    python benchmarks/bench_recompute.py                       # 4-layer Qwen3 shape, sequence 4096, fp32, CPU
    python benchmarks/bench_recompute.py --seq 1024 --out -    # quicker; print only
    python benchmarks/bench_recompute.py --tp 2                # each variant under tensor parallelism, per rank

Each variant runs in its own process (same model, seed and batch; every kernel on), so one cannot inherit
another's high-water mark. Per variant, after a short warm-up step (which allocates the gradients):
- kept: the bytes the forward leaves alive for backward (mindspeed_hf.memory.measure: every storage the forward
  created that is still alive when it returns: saved tensors, checkpoint inputs, outputs), and the bytes autograd
  saved through saved_tensors_hooks (a checkpointed region's inputs are not among those);
- peak: the process high-water mark (VmHWM, reset through /proc/self/clear_refs just before the step) minus the
  resident size before it, with large allocations mmapped (MALLOC_MMAP_THRESHOLD_) so freed memory leaves RSS;
- time: forward + backward of a second step.
Ratios are against `none`. Goals (issue 13): selective <= 0.7x, full <= 0.45x of the activation part.
With `--tp N` each variant runs on N processes (torchrun, gloo) with `parallel: {tp: N}` (sequence parallel); the
figures are rank 0's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"none": {}, "selective": {"recompute": "selective"}, "full": {"recompute": "full"}}


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _model(args):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    # Qwen3-0.6B's layer shape; the vocabulary is smaller (the fused loss keeps the logits out of the picture).
    config = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=args.layers,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=args.vocab,
                         max_position_embeddings=args.seq, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float().train()


def child(args) -> None:
    import torch

    import mindspeed_hf
    from mindspeed_hf.config import config_from_dict
    from mindspeed_hf.memory.measure import measure_forward
    from mindspeed_hf.parallel.parallelize import parallelize

    torch.set_num_threads(args.threads)
    model = _model(args)
    config = config_from_dict({"memory": VARIANTS[args.variant], "parallel": {"tp": args.tp}})
    mindspeed_hf.enable()
    mindspeed_hf.apply_to_model(model, config)
    dims = None
    if args.tp > 1:
        from mindspeed_hf.parallel import ParallelDims, init_distributed

        init_distributed("cpu")
        dims = ParallelDims(tp=args.tp, world_size=args.tp)
        dims.build_mesh("cpu")
    model = parallelize(model, dims, config)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=gen)
    model(input_ids=ids[:, :64], labels=ids[:, :64]).loss.backward()  # warm-up: allocates the gradients
    before = _rss("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    loss, kept = measure_forward(model, lambda: model(input_ids=ids, labels=ids).loss)
    loss.backward()
    peak = _rss("VmHWM") - before
    del loss
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    seconds = time.perf_counter() - start
    if args.tp == 1 or torch.distributed.get_rank() == 0:
        print(json.dumps({"variant": args.variant, "kept": kept.alive_bytes, "saved": kept.saved_bytes,
                          "peak": peak, "seconds": seconds}), flush=True)
    if args.tp > 1:
        torch.distributed.barrier()


def _run(args, variant: str) -> dict:
    env = {**os.environ, "MINDSPEED_HF_AUTO": "0", "MALLOC_MMAP_THRESHOLD_": "65536",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}
    launcher = [sys.executable] if args.tp == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                      f"--nproc_per_node={args.tp}"]
    cmd = [*launcher, __file__, "--child", variant, "--seq", str(args.seq), "--layers", str(args.layers),
           "--vocab", str(args.vocab), "--threads", str(args.threads), "--tp", str(args.tp)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{variant} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("{")))


def table(args, rows: dict[str, dict]) -> str:
    base = rows["none"]
    mib = 2 ** 20
    where = f", tp={args.tp} (rank 0 of {args.tp} processes)" if args.tp > 1 else ""
    lines = [f"# Recompute: activation memory and step time (CPU, fp32, {args.layers}-layer Qwen3-0.6B layer shape, "
             f"vocab {args.vocab}, batch 1 x sequence {args.seq}, {args.threads} thread(s){where})", "",
             "| recompute | kept for backward (MiB) | ratio | saved_tensors_hooks (MiB) | ratio | step peak over "
             "resident (MiB) | ratio | forward+backward (s) | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['kept'] / mib:.0f} | {r['kept'] / base['kept']:.2f}x | {r['saved'] / mib:.0f} | "
                     f"{r['saved'] / base['saved']:.2f}x | {r['peak'] / mib:.0f} | {r['peak'] / base['peak']:.2f}x | "
                     f"{r['seconds']:.1f} | {r['seconds'] / base['seconds']:.2f}x |")
    lines += ["", "selective = memory.recompute_modules default (attention_core, mlp) in every layer; goals: selective "
              "<= 0.7x, full <= 0.45x of the activation part (the `kept` column is that part: the forward's "
              "storages alive at the start of backward).", "",
              f"Produced by `python benchmarks/bench_recompute.py{f' --tp {args.tp}' if args.tp > 1 else ''}`; "
              "each variant in its own process."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel processes per variant (torchrun, gloo)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "recompute_cpu.md"),
                        help="markdown file to write, or - for none")
    args = parser.parse_args()
    if args.child:
        args.variant = args.child
        child(args)
        return
    rows = {variant: _run(args, variant) for variant in VARIANTS}
    text = table(args, rows)
    print(text)
    if args.out != "-":
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
