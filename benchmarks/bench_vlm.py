"""A Qwen2.5-VL-shaped training step, plain Hugging Face vs mindspeed_hf: peak memory and step time as ratios.

Model (built from a config, fp32 on the CPU): vision tower of 4 blocks, hidden 128, 2 heads, patch 14, temporal
patch 2, 2 x 2 merger, window 112 px with full attention in the last block (Qwen2.5-VL's layout); text decoder of 4
layers, hidden 256, intermediate 768, 4 heads of 64 (2 KV), M-RoPE sections (8, 12, 12), vocab 151936, untied
lm_head. Batch: 2 rows, each with 2 images of 448 x 448 (32 x 32 patches: 1024 patches, 256 image tokens each;
4096 patches per step) and 400 random text tokens; labels on the text, -100 on image and vision-special tokens; the
collator is mindspeed_hf.recipes.vl_data.VLCollator (mm_token_type_ids carried). AdamW (lr 1e-4, constant), transformers
Trainer, STEPS steps. Each side runs in its own subprocess, the pairs alternately (MINDSPEED_HF_AUTO=0 for plain HF,
=1 for mindspeed_hf: the import patches what its families describe, the fused chunked loss included):
peak memory is the subprocess's resident-set high-water mark (ru_maxrss: interpreter, weights, gradients and AdamW
state included), step time the median of the steps after the first.

    python benchmarks/bench_vlm.py [--repeats 2] [--threads 0] [--out benchmarks/results/vlm_cpu.md]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from results_io import emit  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "vlm_cpu.md"
VOCAB, IMAGE_SIDE, IMAGES_PER_ROW, TEXT_TOKENS, ROWS, STEPS = 151936, 448, 2, 400, 2, 3
VARIANTS = {"plain HF": "0", "mindspeed_hf": "1"}
TEXT = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]})
VISION = dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=2, patch_size=14, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=256, in_channels=3, window_size=112, fullatt_block_indexes=[3],
              hidden_act="silu")
# Qwen2.5-VL's own special-token ids (inside the 151936 vocabulary).
IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)


def rows(seed: int = 1) -> list[dict]:
    """ROWS training rows in the VLCollator format: images (random patch rows) and random text."""
    import torch

    grid = IMAGE_SIDE // VISION["patch_size"]
    tokens = grid * grid // VISION["spatial_merge_size"] ** 2
    width = 3 * VISION["temporal_patch_size"] * VISION["patch_size"] ** 2
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(ROWS):
        image_part = ([IDS["vision_start_token_id"]] + [IDS["image_token_id"]] * tokens
                      + [IDS["vision_end_token_id"]]) * IMAGES_PER_ROW
        text = torch.randint(0, 151000, (TEXT_TOKENS,), generator=gen).tolist()
        ids = image_part + text
        out.append({"input_ids": ids, "labels": [-100] * len(image_part) + text,
                    "mm_token_type_ids": [int(t == IDS["image_token_id"]) for t in ids],
                    "pixel_values": torch.randn(IMAGES_PER_ROW * grid * grid, width, generator=gen),
                    "image_grid_thw": torch.tensor([[1, grid, grid]] * IMAGES_PER_ROW)})
    return out


def worker(threads: int) -> dict:
    """One measured run in this process (accelerated or not by MINDSPEED_HF_AUTO); returns its numbers."""
    import tempfile

    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    import mindspeed_hf
    from mindspeed_hf.recipes.vl_data import VLCollator

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=False, **IDS)
    model = Qwen2_5_VLForConditionalGeneration(config).float()
    data = rows() * STEPS
    losses, times = [], []

    class StepClock(TrainerCallback):
        """Wall time of every optimizer step (forward, backward, AdamW) and its logged loss."""

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=STEPS, per_device_train_batch_size=ROWS, learning_rate=1e-4,
                                 lr_scheduler_type="constant", report_to="none", save_strategy="no", logging_steps=1,
                                 disable_tqdm=True, use_cpu=True, seed=0, dataloader_pin_memory=False)
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=VLCollator(0),
                          callbacks=[StepClock()])
        init = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    report = mindspeed_hf.report(trainer.model)
    return {"enabled": mindspeed_hf.is_enabled(), "threads": torch.get_num_threads(), "losses": losses,
            "times": times, "peak_bytes": peak * 1024, "init_bytes": init * 1024,
            "kernels": report["kernels"], "vision_kernels": report.get("vision_kernels", {}),
            "patches": sum(len(r["pixel_values"]) for r in rows()), "tokens": sum(len(r["input_ids"]) for r in rows())}


def run_worker(auto: str, threads: int) -> dict:
    """`worker` in a subprocess with MINDSPEED_HF_AUTO=`auto`."""
    path = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, "MINDSPEED_HF_AUTO": auto, "PYTHONPATH": path}
    done = subprocess.run([sys.executable, __file__, "--worker", "--threads", str(threads)], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"MINDSPEED_HF_AUTO={auto} worker failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(result), file=sys.stderr, flush=True)  # progress, and the raw numbers
    return result


def _median_step(run: dict) -> float:
    return statistics.median(run["times"][1:])


def _ratio_row(name: str, base: list[float], fast: list[float], unit: str, fmt: str) -> str:
    """Medians of both sides and their ratio, with the spread of the per-pair ratios (min..max)."""
    pairs = [f / b for b, f in zip(base, fast)]
    b, f = statistics.median(base), statistics.median(fast)
    return (f"| {name} | {b:{fmt}} {unit} | {f:{fmt}} {unit} | **{f / b:.2f}x** "
            f"({min(pairs):.2f}..{max(pairs):.2f} over {len(pairs)} pairs) |")


def _applied(kernels: dict) -> str:
    return ", ".join(f"{op} x{n}" for op, n in kernels.items() if n) or "nothing"


def table(base: list[dict], fast: list[dict]) -> str:
    """The markdown result: memory and time ratios with spread, losses, and what was applied."""
    diff = max(abs(a - b) for a, b in zip(base[0]["losses"], fast[0]["losses"]))
    fmt = lambda losses: ", ".join(f"{x:.5f}" for x in losses)  # noqa: E731
    return "\n".join([
        "| | plain HF | mindspeed_hf | mindspeed_hf / plain |",
        "|---|---|---|---|",
        _ratio_row("peak memory (ru_maxrss)", [r["peak_bytes"] / 1e9 for r in base],
                   [r["peak_bytes"] / 1e9 for r in fast], "GB", ".2f"),
        _ratio_row(f"step time (median of steps 2..{STEPS})", [_median_step(r) for r in base],
                   [_median_step(r) for r in fast], "s", ".2f"),
        f"| resident after model + Trainer built | {base[0]['init_bytes'] / 1e9:.2f} GB | "
        f"{fast[0]['init_bytes'] / 1e9:.2f} GB | |",
        f"| losses per step | {fmt(base[0]['losses'])} | {fmt(fast[0]['losses'])} | max abs diff {diff:.1e} |",
        f"| text kernels | {_applied(base[0]['kernels'])} | {_applied(fast[0]['kernels'])} | |",
        f"| vision kernels | {_applied(base[0]['vision_kernels'])} | {_applied(fast[0]['vision_kernels'])} | |",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (0 = torch's default)")
    parser.add_argument("--repeats", type=int, default=2, help="plain/accelerated pairs, run alternately")
    parser.add_argument("--out", default=str(RESULT))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.threads)))
        return
    base, fast = [], []
    for _ in range(args.repeats):  # alternate so that load from other processes hits both alike
        base.append(run_worker(VARIANTS["plain HF"], args.threads))
        fast.append(run_worker(VARIANTS["mindspeed_hf"], args.threads))
    first = base[0]
    lines = [
        "# Qwen2.5-VL-shaped training step: mindspeed_hf vs plain HF (CPU, fp32)",
        "",
        f"Vision: {VISION['depth']} blocks x {VISION['hidden_size']} (patch {VISION['patch_size']}, window "
        f"{VISION['window_size']} px, full attention in block {VISION['fullatt_block_indexes']}); text: "
        f"{TEXT['num_hidden_layers']} layers x {TEXT['hidden_size']}, vocab {VOCAB}, untied lm_head. Per step: "
        f"{ROWS} rows, {ROWS * IMAGES_PER_ROW} images of {IMAGE_SIDE} x {IMAGE_SIDE} = {first['patches']} patches, "
        f"{first['tokens']} tokens. transformers Trainer, AdamW, {STEPS} steps; {args.repeats} plain/accelerated "
        f"subprocess pairs run alternately, torch threads {first['threads']}. Peak memory: ru_maxrss of each "
        "subprocess. The ratios are of the medians; the spread is the min..max of the per-pair ratios. The "
        "machine's cores are shared with other jobs, so step times vary between identical runs; memory does not.",
        "",
        table(base, fast),
        "",
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
