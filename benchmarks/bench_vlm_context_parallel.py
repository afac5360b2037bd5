"""Context parallelism through a vision-language model: per-rank activation memory and step time of one training
step on a long video-shaped input, cp=1 vs cp=2 / cp=4, with and without parallel.cp_vision.

    torchrun --nproc_per_node 4 benchmarks/bench_vlm_context_parallel.py \
        --out benchmarks/results/vlm_context_parallel_cpu.md

One 4-rank launch (gloo, CPU, fp32) runs every layout on the same model and row: a tiny Qwen2.5-VL (tests/tiny_vlms:
text decoder of 2 layers, width 64; vision tower of 2 blocks, width 32) and one row of a video of --frames temporal
patches of --size x --size patches (--size^2 / 4 tokens per frame) between two short texts. Layouts: cp=1
(dp_shard=4: every rank runs the whole row), cp=2 and cp=4 ring, cp=4 hybrid 2 x 2, and cp=2 / cp=4 ring with
cp_vision (each rank runs the tower on its share of the frames). Activations: the bytes of the storages a forward
creates that are still alive when it returns (what backward needs; mindspeed_hf.memory.measure, parameters
excluded), on rank 0. Time: the median of --steps forward + backward steps after a warm-up, with the min..max
spread (4 processes share this machine's cores: times compare layouts with each other, not with a cluster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))  # tiny_vlms

from bench_context_parallel import measure_step  # noqa: E402  (the same measuring step as for text)
from results_io import emit  # noqa: E402
from tiny_vlms import END, START, VIDEO, tiny_vlm  # noqa: E402

from mindspeed_hf.config import MindSpeedConfig, ParallelConfig  # noqa: E402
from mindspeed_hf.parallel import ParallelDims, init_distributed, parallelize  # noqa: E402

LAYOUTS = {  # name: (cp, cp_ulysses, cp_vision)
    "cp1": (1, 1, False), "cp2 ring": (2, 1, False), "cp2 ring + cp_vision": (2, 1, True),
    "cp4 ring": (4, 1, False), "cp4 ring + cp_vision": (4, 1, True), "cp4 hybrid 2x2": (4, 2, False),
}
PATCH = 3 * 2 * 4 * 4  # in_channels * temporal_patch_size * patch_size^2 of the tiny tower


def video_row(frames: int, size: int) -> dict[str, torch.Tensor]:
    """One row: 16 text tokens, the video's placeholder tokens, 16 text tokens; labels on the text only."""
    gen = torch.Generator().manual_seed(1)
    tokens = frames * size * size // 4
    text = torch.randint(3, 240, (32,), generator=gen)
    ids = torch.cat([text[:16], torch.tensor([START] + [VIDEO] * tokens + [END]), text[16:]]).unsqueeze(0)
    labels = ids.masked_fill((ids == VIDEO) | (ids == START) | (ids == END), -100)
    grid = torch.tensor([[frames, size, size]])
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids),
            "pixel_values_videos": torch.randn(frames * size * size, PATCH, generator=gen), "video_grid_thw": grid,
            "second_per_grid_ts": torch.tensor([1.0]), "use_cache": False}


def measure(cp: int, ulysses: int, vision: bool, row: dict, steps: int) -> tuple[int, list[float]]:
    dims = ParallelDims(dp_shard=-1, cp=cp, cp_ulysses=ulysses)
    dims.build_mesh("cpu")
    parallel = ParallelConfig(cp=cp, cp_ulysses=ulysses, cp_vision=vision)
    model = parallelize(tiny_vlm("qwen2_5_vl"), dims, MindSpeedConfig(parallel=parallel))
    return measure_step(model, row, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=32)
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out")
    opts = parser.parse_args()
    init_distributed("cpu")
    torch.set_num_threads(1)
    row = video_row(opts.frames, opts.size)
    results = {name: measure(cp, u, v, row, opts.steps) for name, (cp, u, v) in LAYOUTS.items()}
    if dist.get_rank() != 0:
        return
    base_mem, base_times = results["cp1"]
    base = statistics.median(base_times)
    seq, patches = row["input_ids"].shape[1], row["pixel_values_videos"].shape[0]
    lines = [f"# Context parallelism through a vision-language model on CPU: one row of {seq} tokens (a video of "
             f"{opts.frames} x {opts.size} x {opts.size} = {patches} patches), tiny Qwen2.5-VL, "
             f"{dist.get_world_size()} ranks (gloo, fp32)", "",
             "| layout | activations per rank (MiB) | vs cp1 | step time (s), median [min-max] | vs cp1 |",
             "|---|---|---|---|---|"]
    for name, (mem, times) in results.items():
        median = statistics.median(times)
        lines.append(f"| {name} | {mem / 2**20:.1f} | {mem / base_mem:.2f}x | {median:.3f} [{min(times):.3f}-"
                     f"{max(times):.3f}] | {median / base:.2f}x |")
    emit("\n".join(lines) + "\n", opts.out)


if __name__ == "__main__":
    main()
