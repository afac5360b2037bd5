"""Qwen2.5-Omni-shaped thinker (or talker) training step on CPU: plain HF vs mindspeed_hf, each in its own process,
alternating pairs: step time, peak resident memory and per-step losses.

    python benchmarks/bench_omni.py [--repeats 3] [--out benchmarks/results/omni_cpu.md]
    python benchmarks/bench_omni.py --model qwen2_5_omni_talker --out benchmarks/results/omni_talker_cpu.md

The thinker is tests/tiny_omni's with Qwen2.5-Omni's vocabulary (151936); each step is forward, backward and AdamW
on two rows, each with one audio clip (mel features of 130 and 70 frames), one image (8x8 and 4x4 patches) and --text
text tokens, right-padded. A talker (`--model qwen2_5_omni_talker` / `qwen3_omni_moe_talker`) is tests/tiny_talker's
with the released codec vocabulary (8448 / 3072) on two rows of --text and 3/4 of --text codes after a short prompt,
labels the codes (Qwen3-Omni: the talker's codebook 0; its code predictor is not in the step). On CPU the attention
kernels are torch's on both sides: the figures are the fused loss (the [tokens, vocabulary] logits HF builds) and the
other kernels. On plain HF the talker's loss is HF's loss function on its logits (its forward takes no labels).
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

TALKER_VOCAB = {"qwen2_5_omni_talker": 8448, "qwen3_omni_moe_talker": 3072}  # the released codec vocabularies


def _talker(args) -> tuple:
    """(module whose forward returns .loss, batch): the tiny talker with the released codec vocabulary; on plain HF
    wrapped to score HF's loss function on its logits (HF's talker forwards compute no usable loss: Qwen2.5-Omni's
    takes no labels, Qwen3-Omni's reads a config.vocab_size its config lacks)."""
    from types import SimpleNamespace

    import torch
    from tiny_talker import qwen3_talker_batch, talker_batch, tiny_talker

    import mindspeed_hf

    class PlainLoss(torch.nn.Module):
        def __init__(self, talker: torch.nn.Module) -> None:
            super().__init__()
            self.talker = talker

        def forward(self, labels: torch.Tensor, **inputs) -> SimpleNamespace:
            logits = self.talker(**inputs).logits
            return SimpleNamespace(loss=self.talker.loss_function(logits=logits, labels=labels,
                                                                  vocab_size=logits.shape[-1]))

    model = tiny_talker(args.model, vocab=TALKER_VOCAB[args.model]).train()
    codes = (args.text, args.text * 3 // 4)
    batch = (qwen3_talker_batch(model, lengths=tuple(n + 8 for n in codes)) if "qwen3" in args.model
             else talker_batch(model, prompts=(8, 6), frames=codes))
    return (model if mindspeed_hf.is_enabled() else PlainLoss(model)), batch


def worker(args) -> dict:
    import torch
    from tiny_omni import omni_batch, tiny_omni_thinker

    import mindspeed_hf

    torch.set_num_threads(1)
    if args.model in TALKER_VOCAB:
        model, batch = _talker(args)
    else:
        model = tiny_omni_thinker(args.model)
        model.config.text_config.vocab_size = args.vocab  # Qwen2.5-Omni's vocabulary: rebuilt with it
        torch.manual_seed(0)
        model = type(model)(model.config).float().train()
        batch = omni_batch(model, text=args.text)
    if mindspeed_hf.is_enabled():
        mindspeed_hf.apply_to_model(model)
    return timed_steps(model, batch, args.steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2_5_omni_thinker")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--text", type=int, default=512,
                        help="text tokens after each row's audio and image (a talker: codes per row)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    runs = alternating_pairs(__file__, args.repeats)
    if args.model in TALKER_VOCAB:
        what = (f"# Omni talker step on CPU: tiny {args.model} (tests/tiny_talker) with codec vocabulary "
                f"{TALKER_VOCAB[args.model]}, two rows of {args.text} and {args.text * 3 // 4} codes")
    else:
        what = (f"# Omni thinker step on CPU: tiny {args.model} (tests/tiny_omni) with vocabulary {args.vocab}, two "
                f"rows with one audio clip, one image and {args.text} text tokens each")
    lines = [f"{what}, fp32, one thread; {args.repeats} alternating process pairs, {args.steps} steps each (median "
             f"after the first)", "", *paired_rows(runs)]
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
