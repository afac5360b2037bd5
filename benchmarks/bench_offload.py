"""Activation offload: peak memory and step time of one training step, offload vs none, side by side.

    python benchmarks/bench_offload.py                              # CPU: 4-layer Qwen3-0.6B layer shape, seq 4096
    python benchmarks/bench_offload.py --device cuda --dtype bf16 --layers 8 --seq 4096 --out gpu/offload.md

Each variant (none, offload, full recompute, full recompute + offload) runs in its own process with the same model,
seed and batch, every kernel on, torch's AdamW (mindspeed_hf.bench.memory_report.measure_step: a warm-up step
allocates gradients, optimizer state and the host buffers, then one step is measured):
- activations: on CUDA / NPU the allocator's peak over forward + backward minus what was allocated before it (the
  figure offload is for); on the CPU the bytes the forward keeps on the device for backward, less what offload
  freed (the offloaded copies are in the same RAM there, so the process peak column shows what the CPU really pays);
- step peak: parameters + gradients + optimizer state + activations;
- time: the median of `--steps` timed training steps (forward + backward + optimizer step) after the measured one.
Ratios are against `none` (and full + offload also against full). Goal on a GPU (issue 13): offload >= 40% less
activation memory at <= 10% more time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"none": {}, "offload": {"offload_activations": True}, "full": {"recompute": "full"},
            "full+offload": {"recompute": "full", "offload_activations": True}}


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _model(args):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=args.layers,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=args.vocab,
                         max_position_embeddings=args.seq, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    return AutoModelForCausalLM.from_config(config).to(dtype=dtype, device=args.device).train()


def child(args) -> None:
    import torch

    import mindspeed_hf
    from mindspeed_hf.bench.memory_report import measure_step
    from mindspeed_hf.config import config_from_dict
    from mindspeed_hf.device import device_module
    from mindspeed_hf.parallel.parallelize import parallelize

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    model = _model(args)
    config = config_from_dict({"memory": {**VARIANTS[args.variant], "offload_min_bytes": args.min_bytes}})
    mindspeed_hf.enable()
    mindspeed_hf.apply_to_model(model, config)
    model = parallelize(model, None, config)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids.to(args.device), "labels": ids.to(args.device)}
    before = _rss("VmRSS")
    if args.device == "cpu":
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    params, grads, state, activations, offloaded, loss = measure_step(model, batch, 1e-5, args.device)
    rss_peak = _rss("VmHWM") - before
    module = device_module(args.device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    seconds = []
    for _ in range(args.steps):
        if module is not None:
            module.synchronize()
        start = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if module is not None:
            module.synchronize()
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"variant": args.variant, "params": params, "grads": grads, "state": state,
                      "activations": activations, "offloaded": offloaded, "loss": loss, "rss_peak": rss_peak,
                      "seconds": statistics.median(seconds)}))


def _run(args, variant: str) -> dict:
    env = {**os.environ, "MINDSPEED_HF_AUTO": "0", "MALLOC_MMAP_THRESHOLD_": "65536",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, __file__, "--child", variant]
    for name in ("device", "dtype", "seq", "batch", "layers", "vocab", "threads", "steps", "min_bytes"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{variant} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(args, rows: dict[str, dict]) -> str:
    mib = 2 ** 20
    base = rows["none"]
    what = "allocator peak over forward + backward" if args.device != "cpu" else "kept on the device for backward"
    lines = [f"# Activation offload: memory and step time ({args.device}, {args.dtype}, {args.layers}-layer "
             f"Qwen3-0.6B layer shape, vocab {args.vocab}, batch {args.batch} x sequence {args.seq}, "
             f"offload_min_bytes {args.min_bytes})", "",
             f"| variant | activations (MiB; {what}) | ratio | offloaded (MiB) | step peak (MiB) | ratio | "
             "process peak over resident (MiB) | step time (s) | ratio | loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        ref = rows["full"] if name == "full+offload" else base
        peak = r["params"] + r["grads"] + r["state"] + r["activations"]
        ref_peak = ref["params"] + ref["grads"] + ref["state"] + ref["activations"]
        vs = " vs full" if name == "full+offload" else ""
        rss = f"{r['rss_peak'] / mib:.0f}" if args.device == "cpu" else "-"
        lines.append(f"| {name} | {r['activations'] / mib:.0f} | {r['activations'] / ref['activations']:.2f}x{vs} | "
                     f"{r['offloaded'] / mib:.0f} | {peak / mib:.0f} | {peak / ref_peak:.2f}x{vs} | {rss} | "
                     f"{r['seconds']:.2f} | {r['seconds'] / ref['seconds']:.2f}x{vs} | {r['loss']:.6f} |")
    lines += ["", "Goal on a GPU: offload >= 40% less activation memory at <= 10% more time. Produced by "
              f"`python benchmarks/bench_offload.py {' '.join(sys.argv[1:])}`; each variant in its own process."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "npu"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per variant, median (default 1 on the CPU, 3 on an accelerator)")
    parser.add_argument("--min-bytes", type=int, default=1 << 20, help="memory.offload_min_bytes")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset (none is always run)")
    parser.add_argument("--out", default=None, help="markdown file to write (default benchmarks/results/"
                                                    "offload_<device>.md), or - for none")
    args = parser.parse_args()
    args.steps = args.steps or (1 if args.device == "cpu" else 3)
    if args.child:
        args.variant = args.child
        child(args)
        return
    chosen = ["none", *[v for v in args.variants.split(",") if v in VARIANTS and v != "none"]]
    if "full+offload" in chosen and "full" not in chosen:
        chosen.insert(chosen.index("full+offload"), "full")
    rows = {variant: _run(args, variant) for variant in chosen}
    text = table(args, rows)
    print(text)
    out = args.out or str(REPO / "benchmarks" / "results" / f"offload_{args.device}.md")
    if out != "-":
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)


if __name__ == "__main__":
    main()
