"""Qwen3-TTS fine-tuning steps (the examples/qwen3_tts objective: talker + 0.3 x code predictor, AdamW): step time and
peak memory, plain Hugging Face vs mindspeed_hf, each run in its own process; the pair is repeated and the ratios
are reported as median [min-max] over the repeats. Needs qwen-tts (transformers 4.57, see examples/qwen3_tts).

    python benchmarks/bench_qwen3_tts.py --hidden 64 --layers 2 --repeats 3
    python benchmarks/bench_qwen3_tts.py --hidden 256 --layers 4 --batch 8 --out benchmarks/results/qwen3_tts_cpu.md

Peak memory is the allocator peak on an accelerator and the process's resident high-water mark on the CPU (there
it includes the Python/torch baseline in both columns).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from results_io import add_run_arguments, emit, paired_rows, run_worker_self

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"plain HF": "0", "mindspeed_hf": "1"}


def _worker(args: argparse.Namespace) -> None:
    sys.path[:0] = [str(REPO / "tests"), str(REPO / "examples" / "qwen3_tts")]
    import torch
    from data import Collator, synthetic_rows
    from tiny_models import tiny_tts_model
    from tts_loss import Qwen3TTSFinetune

    import mindspeed_hf  # enabled or not by MINDSPEED_HF_AUTO, set by the parent
    from mindspeed_hf.device import detect_device_type, device_module, peak_memory_bytes, reset_peak_memory

    device = args.device or detect_device_type()
    model = tiny_tts_model(hidden=args.hidden, layers=args.layers).to(device)
    module = Qwen3TTSFinetune(model)
    if mindspeed_hf.is_enabled():
        mindspeed_hf.apply_to_model(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    rows = synthetic_rows(model.config, args.batch, text_len=(args.text, args.text), frames=(args.frames, args.frames))
    batch = {k: v.to(device) for k, v in Collator(model.config)(rows).items()}
    accelerator = device_module(device)

    def step() -> float:
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = module(**batch)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if accelerator is not None:
            accelerator.synchronize()
        return loss.item()

    reset_peak_memory(device)
    losses, times = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - start)
    print(json.dumps({"losses": losses, "step": statistics.median(times[1:] or times),
                      "peak_bytes": peak_memory_bytes(device), "report": mindspeed_hf.report(module)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=64, help="talker width (a multiple of 32)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--text", type=int, default=24, help="text tokens per row")
    parser.add_argument("--frames", type=int, default=48, help="speech frames per row (12.5 per second)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="plain / mindspeed_hf process pairs")
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)

    runs = [{name: run_worker_self(__file__, auto) for name, auto in VARIANTS.items()} for _ in range(args.repeats)]
    ours = runs[-1]["mindspeed_hf"]
    kernels = ", ".join(f"{k} x{v}" for k, v in ours["report"]["kernels"].items() if v)
    lines = [f"Qwen3-TTS: talker hidden {args.hidden}, {args.layers} layers (code predictor {args.hidden // 2} wide), "
             f"batch {args.batch} x ({args.text} text + {args.frames} frames), {args.dtype}, {args.steps} steps, "
             f"{args.repeats} process pairs, backend {ours['report']['backend']} ({kernels})", "", *paired_rows(runs)]
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
