"""Context parallelism: per-rank activation memory and step time of one training step, cp=1 vs cp=2 / cp=4.

    torchrun --nproc_per_node 4 benchmarks/bench_context_parallel.py --out benchmarks/results/context_parallel_cpu.md

One 4-rank launch (gloo, CPU, fp32, tiny-width llama, one sequence of --seq tokens per dp rank) runs every layout
on the same model and sequence: cp=1 (dp_shard=4, HF's own sdpa on the whole sequence), cp=2 (dp_shard=2 x cp=2)
ring and Ulysses, cp=4 ring, Ulysses and hybrid 2 x 2. Activations: the bytes of the storages a forward creates
that are still alive when it returns (what backward needs; mindspeed_hf.memory.measure, parameters excluded), on
rank 0. Time: the median of --steps forward + backward steps after a warm-up (4 processes share this machine's
cores, so times compare layouts with each other, not with a real cluster). Goals (issue 10): activations at cp=2
<= 0.55x of cp=1, at cp=4 <= 0.3x.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import emit  # noqa: E402

from mindspeed_hf.config import MindSpeedConfig, ParallelConfig  # noqa: E402
from mindspeed_hf.memory.measure import measure_forward  # noqa: E402
from mindspeed_hf.parallel import ParallelDims, context_of, init_distributed, parallelize, split_cp_batch  # noqa: E402

LAYOUTS = {  # name: (cp, cp_ulysses)
    "cp1": (1, 1), "cp2 ring": (2, 1), "cp2 ulysses": (2, 2), "cp4 ring": (4, 1), "cp4 ulysses": (4, 4),
    "cp4 hybrid 2x2": (4, 2),
}


def build_model(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, vocab_size=256, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1 << 16, tie_word_embeddings=False, attn_implementation="sdpa"))


def measure_step(model, batch: dict, steps: int) -> tuple[int, list[float]]:
    """(activation bytes alive after one forward, the times of `steps` forward + backward steps) of `model` on its
    cp share of `batch`, after a warm-up step."""
    ctx = context_of(model)
    local = split_cp_batch(batch, ctx) if ctx is not None else batch
    model(**local).loss.backward()  # warm-up
    loss, memory = measure_forward(model, lambda: model(**local).loss)
    loss.backward()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        model(**local).loss.backward()
        times.append(time.perf_counter() - start)
    return memory.alive_bytes, times


def measure(cp: int, ulysses: int, seq: int, layers: int, steps: int) -> tuple[int, float]:
    dims = ParallelDims(dp_shard=-1, cp=cp, cp_ulysses=ulysses)
    dims.build_mesh("cpu")
    model = parallelize(build_model(layers), dims, MindSpeedConfig(parallel=ParallelConfig(cp=cp, cp_ulysses=ulysses)))
    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(1))
    alive, times = measure_step(model, {"input_ids": ids, "labels": ids, "use_cache": False}, steps)
    return alive, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out")
    opts = parser.parse_args()
    init_distributed("cpu")
    results = {name: measure(cp, u, opts.seq, opts.layers, opts.steps) for name, (cp, u) in LAYOUTS.items()}
    if dist.get_rank() != 0:
        return
    base_mem, base_time = results["cp1"]
    lines = [f"# Context parallelism on CPU: seq {opts.seq}, {opts.layers}-layer llama (width 64), "
             f"{dist.get_world_size()} ranks (gloo, fp32)", "",
             "| layout | activations per rank (MiB) | vs cp1 | step time (s) | vs cp1 |", "|---|---|---|---|---|"]
    for name, (mem, secs) in results.items():
        lines.append(f"| {name} | {mem / 2**20:.1f} | {mem / base_mem:.2f}x | {secs:.3f} | {secs / base_time:.2f}x |")
    emit("\n".join(lines) + "\n", opts.out)


if __name__ == "__main__":
    main()
