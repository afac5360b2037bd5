"""Qwen2.5-Omni-shaped thinker training step on CPU: plain HF vs mindspeed_hf, each in its own process, alternating
pairs: step time, peak resident memory and per-step losses.

    python benchmarks/bench_omni.py [--repeats 3] [--out benchmarks/results/omni_cpu.md]

The thinker is tests/tiny_omni's with Qwen2.5-Omni's vocabulary (151936); each step is forward, backward and AdamW
on two rows, each with one audio clip (mel features of 130 and 70 frames), one image (8x8 and 4x4 patches) and --text
text tokens, right-padded. On CPU the attention kernels are torch's on both sides: the figures are the fused loss
(the [tokens, 151936] logits HF builds) and the other kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))  # tiny_omni

from results_io import alternating_pairs, emit, paired_rows, timed_steps  # noqa: E402


def worker(args) -> dict:
    import torch
    from tiny_omni import omni_batch, tiny_omni_thinker

    import mindspeed_hf

    torch.set_num_threads(1)
    model = tiny_omni_thinker(args.model)
    model.config.text_config.vocab_size = args.vocab  # Qwen2.5-Omni's vocabulary: rebuilt with it
    torch.manual_seed(0)
    model = type(model)(model.config).float().train()
    if mindspeed_hf.is_enabled():
        mindspeed_hf.apply_to_model(model)
    return timed_steps(model, omni_batch(model, text=args.text), args.steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2_5_omni_thinker")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--text", type=int, default=512, help="text tokens after each row's audio and image")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    runs = alternating_pairs(__file__, args.repeats)
    lines = [f"# Omni thinker step on CPU: tiny {args.model} (tests/tiny_omni) with vocabulary {args.vocab}, two rows "
             f"with one audio clip, one image and {args.text} text tokens each, fp32, one thread; {args.repeats} "
             f"alternating process pairs, {args.steps} steps each (median after the first)", "", *paired_rows(runs)]
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
