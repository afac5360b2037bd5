"""Peak memory and time of `mindspeed-hf export` on a Qwen3-0.6B-shaped sharded checkpoint (random weights).

    python benchmarks/bench_export.py [--dtype bf16] [--layers 28] [--shard-sizes 5GB,300MB]
                                      [--out benchmarks/results/export_cpu.md]

Writes a checkpoint the way a sharded Trainer run does (DCP shards of the model, the config beside them, the
COMPLETE marker), then runs the export in a child process (`--repeats` times per output file size) and reports its
resident-memory high-water mark (the child's VmHWM) above the imports, against the model's tensors and against the
bound the streamed export promises (the largest output file plus the largest tensor), and its wall time.
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

os.environ.setdefault("MINDSPEED_HF_AUTO", "0")
REPO = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def write_checkpoint(root: str, args) -> tuple[str, int, int]:
    """checkpoint-1 of a Qwen3-0.6B-shaped model (its tensors in `args.dtype`); returns (path, tensor bytes, largest
    tensor's bytes)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from mindspeed_hf.checkpoints.layout import MODEL_DIR
    from mindspeed_hf.parallel.checkpoint import mark_complete
    from mindspeed_hf.runtime.state import save_configs

    config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=args.layers,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(getattr(torch, DTYPES[args.dtype]))
    path = os.path.join(root, "checkpoint-1")
    state = model.state_dict()
    dcp.save({"model": state}, checkpoint_id=os.path.join(path, MODEL_DIR), no_dist=True)
    save_configs(model, path)
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 1}, f)
    mark_complete(path, global_step=1)
    sizes = [t.numel() * t.element_size() for t in {t.data_ptr(): t for t in state.values()}.values()]
    return path, sum(sizes), max(sizes)


def largest_file(out: str) -> int:
    return max(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))


def measure(checkpoint: str | None, out: str, shard_size: str = "5GB") -> tuple[float, int]:
    """(seconds, peak RSS bytes) of one export in a fresh process (checkpoint None: the imports alone)."""
    env = {**os.environ, "MINDSPEED_HF_AUTO": "0", "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    # VmHWM: this process's own peak (ru_maxrss would carry the parent's peak over fork + exec)
    code = ("import sys, transformers, peft; from mindspeed_hf.checkpoints.export import export;"
            "sys.argv[1] != '-' and export(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[3]);"
            "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, checkpoint or "-", out, shard_size], env=env, check=True,
                          capture_output=True, text=True)
    return time.perf_counter() - start, int(proc.stdout.strip().splitlines()[-1]) * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shard-sizes", default="5GB,300MB", help="output file sizes (max_shard_size), comma-separated")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results_io import emit

    gib = 1 << 30
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint, size, largest = write_checkpoint(tmp, args)
        imports = measure(None, tmp)[1]
        for shard_size in args.shard_sizes.split(","):
            runs = [measure(checkpoint, os.path.join(tmp, f"hf-{shard_size}-{i}"), shard_size)
                    for i in range(args.repeats)]
            seconds, peaks = [r[0] for r in runs], [(r[1] - imports) / gib for r in runs]
            bound = (largest_file(os.path.join(tmp, f"hf-{shard_size}-0")) + largest) / gib
            rows.append(f"| {shard_size} | {statistics.median(peaks):.2f} [{min(peaks):.2f}-{max(peaks):.2f}] | "
                        f"{statistics.median(peaks) * gib / size:.2f}x | {bound:.2f} | {statistics.median(seconds):.1f}"
                        f" [{min(seconds):.1f}-{max(seconds):.1f}] |")
    lines = [f"Qwen3-0.6B shape ({args.layers} layers, hidden 1024, vocabulary 151936, tied embeddings), {args.dtype}, "
             f"random weights: {size / gib:.2f} GiB of tensors, the largest (the embedding) {largest / gib:.2f} GiB. "
             f"Sharded checkpoint (DCP) exported by `mindspeed_hf.export` in a fresh process, {args.repeats} runs per "
             f"output file size, median [min-max]; peak = VmHWM above the imports alone ({imports / gib:.2f} GiB).",
             "", "| max_shard_size | peak above imports (GiB) | of the model | bound: largest file + largest tensor "
             "(GiB) | seconds |", "|---|---|---|---|---|", *rows]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
