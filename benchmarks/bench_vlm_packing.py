"""Packed vs padded multimodal batches: tokens/s of the same training rows through mindspeed_hf, padded by a plain
collator or packed by mindspeed_hf.data.FlatteningCollator (one row per batch), and the per-step losses.

    python benchmarks/bench_vlm_packing.py [--repeats 3] [--out benchmarks/results/vlm_packing_cpu.md]

A mixed-length multimodal set (--rows rows: 16 to --max-text text tokens, none to two images of 4x4 to 16x16
patches each, labels on the text) goes through a tiny Qwen2.5-VL (tests/tiny_vlms, fp32, CPU, kernels on) in batches
of --batch rows, forward + backward + AdamW, one epoch. Each layout runs in its own process, the pairs alternately;
tokens/s = real (non-padding) tokens of the epoch / the summed step times after the first batch, so both layouts
count the same tokens and padding shows as time. The losses of a step are the same rows either way (packing keeps
each row's positions and boundaries: FlatteningCollator's contract), so they must agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))  # tiny_vlms

from results_io import emit, run_worker_self, spread  # noqa: E402

PATCH = 3 * 2 * 4 * 4  # in_channels * temporal_patch_size * patch_size^2 of the tiny tower


def make_rows(count: int, max_text: int, seed: int = 0) -> list[dict]:
    from tiny_vlms import END, IMAGE, START

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        ids = torch.randint(3, 240, (int(torch.randint(16, max_text + 1, (1,), generator=gen)),),
                            generator=gen).tolist()
        grids = [(1, 4 * int(torch.randint(1, 5, (1,), generator=gen)), 4 * int(torch.randint(1, 5, (1,),
                                                                                               generator=gen)))
                 for _ in range(int(torch.randint(0, 3, (1,), generator=gen)))]
        for grid in grids:
            cut = int(torch.randint(0, len(ids) + 1, (1,), generator=gen))
            ids[cut:cut] = [START] + [IMAGE] * (grid[1] * grid[2] // 4) + [END]
        input_ids = torch.tensor(ids)
        row = {"input_ids": ids, "labels": input_ids.masked_fill(
            (input_ids == IMAGE) | (input_ids == START) | (input_ids == END), -100).tolist()}
        if grids:
            grid = torch.tensor(grids)
            row["image_grid_thw"] = grid
            row["pixel_values"] = torch.randn(int(grid.prod(-1).sum()), PATCH, generator=gen)
        rows.append(row)
    return rows


def worker(args) -> dict:
    from tiny_vlms import pad_rows, tiny_vlm

    import mindspeed_hf  # noqa: F401  (MINDSPEED_HF_AUTO=1: kernels on)
    from mindspeed_hf.data import FlatteningCollator

    torch.set_num_threads(1)
    model = tiny_vlm("qwen2_5_vl").train()
    collate = FlatteningCollator() if args.layout == "packed" else pad_rows
    rows = make_rows(args.rows, args.max_text)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times, tokens = [], [], 0
    for step, start in enumerate(range(0, len(rows), args.batch)):
        part = rows[start:start + args.batch]
        batch = collate(part)
        began = time.perf_counter()
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:  # the first batch pays one-time costs
            times.append(time.perf_counter() - began)
            tokens += sum(len(row["input_ids"]) for row in part)
        losses.append(loss.item())
    padded = sum(args.batch * max(len(r["input_ids"]) for r in rows[i:i + args.batch])
                 for i in range(0, len(rows), args.batch))
    return {"tokens_per_s": tokens / sum(times), "losses": losses, "step": statistics.median(times),
            "padding": 1 - sum(len(r["input_ids"]) for r in rows) / padded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-text", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layout", choices=["padded", "packed"], default="padded")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    pairs = []
    for repeat in range(args.repeats):
        order = ("padded", "packed") if repeat % 2 == 0 else ("packed", "padded")
        pairs.append({name: run_worker_self(__file__, "1", "--layout", name, OMP_NUM_THREADS="1") for name in order})
    first = pairs[0]
    diff = max(abs(a - b) for p in pairs for a, b in zip(p["padded"]["losses"], p["packed"]["losses"], strict=True))
    lines = [f"# Packed vs padded multimodal batches on CPU: {args.rows} rows (16 to {args.max_text} text tokens, 0-2 "
             f"images each), batches of {args.batch}, tiny Qwen2.5-VL, fp32, kernels on; {args.repeats} alternating "
             f"process pairs", "",
             f"Padding in the padded batches: {first['padded']['padding']:.0%} of the positions.", "",
             "| layout | tokens/s (median of pairs) | step time (s, median of pairs) |", "|---|---|---|"]
    for name in ("padded", "packed"):
        lines.append(f"| {name} | {statistics.median(p[name]['tokens_per_s'] for p in pairs):,.0f} | "
                     f"{statistics.median(p[name]['step'] for p in pairs):.3f} |")
    ratio = [p["packed"]["tokens_per_s"] / p["padded"]["tokens_per_s"] for p in pairs]
    lines += ["", f"packed / padded tokens/s: {spread(ratio)}; max per-step |loss diff| {diff:.2e}"]
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
