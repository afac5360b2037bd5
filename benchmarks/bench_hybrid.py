"""Qwen3.5-shaped hybrid model (Gated DeltaNet + gated attention, 3 of every 4 layers linear) on CPU: plain HF vs
mindspeed_hf, each in its own process, alternating pairs.

    python benchmarks/bench_hybrid.py [--repeats 3] [--out benchmarks/results/hybrid_cpu.md]

1. A training step (forward, backward, AdamW) on a right-padded batch: step time and peak memory (the process's
   resident high-water mark on CPU), per-step losses.
2. The Gated DeltaNet layer alone, forward + backward on one packed row of documents: HF's forward on the packed row
   (which carries the state across the documents) vs ours (the documents as rows: each its own state), and HF's
   forward on the same documents as padded rows (the reference ours must equal: max |output diff| reported).
On CPU both sides run transformers' torch chunked rule: the step figures are the other kernels' (the fused loss
above all, with a 32k vocabulary), and part 2 is the price of keeping packed documents apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from results_io import alternating_pairs, emit, paired_rows, run_worker_self, spread, timed_steps  # noqa: E402

DOCS = (300, 140, 60, 12)  # one packed row of documents


def _config(args):
    from transformers import AutoConfig

    layers = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * (args.layers // 4)
    return AutoConfig.for_model(
        "qwen3_5_text", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=len(layers), layer_types=layers, num_attention_heads=8, num_key_value_heads=2,
        head_dim=args.hidden // 8, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=args.hidden // 8, linear_value_head_dim=args.hidden // 8, tie_word_embeddings=False,
        max_position_embeddings=4096)


def _step(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import mindspeed_hf

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(args)).float().train()
    if mindspeed_hf.is_enabled():
        mindspeed_hf.apply_to_model(model)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    mask = torch.ones_like(ids)
    mask[1:, args.seq * 3 // 4:] = 0  # a padded row
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100), "use_cache": False}
    return timed_steps(model, batch, args.steps)


def _layer(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import mindspeed_hf
    from mindspeed_hf.config import config_from_dict

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(args)).float()
    layer = model.model.layers[0].linear_attn
    gen = torch.Generator().manual_seed(2)
    total = sum(DOCS)
    packed = torch.randn(1, total, args.hidden, generator=gen)
    rows = torch.zeros(len(DOCS), max(DOCS), args.hidden)
    mask = torch.zeros(len(DOCS), max(DOCS), dtype=torch.long)
    start = 0
    for row, n in enumerate(DOCS):
        rows[row, :n], mask[row, :n] = packed[0, start:start + n], 1
        start += n

    def timed(run) -> tuple[float, torch.Tensor]:
        times = []
        for _ in range(args.steps):
            x = packed.clone().requires_grad_()
            began = time.perf_counter()
            out = run(x)
            out.square().mean().backward()
            times.append(time.perf_counter() - began)
        return statistics.median(times[1:]), out.detach()

    hf_time, hf_packed = timed(lambda x: layer(x))
    with torch.no_grad():
        reference = torch.cat([layer(rows, attention_mask=mask)[i, :n] for i, n in enumerate(DOCS)])[None]
    mindspeed_hf.enable(config_from_dict({"backend": "torch"}))
    mindspeed_hf.apply_to_model(model)
    from mindspeed_hf.ops import varlen
    from mindspeed_hf.patches import linear_attention

    document_ids = torch.repeat_interleave(torch.arange(len(DOCS)), torch.tensor(DOCS))[None]
    documents = varlen.varlen_info(document_ids, "sequence_ids")  # what the text model finds for a packed row

    def ours(x):
        with linear_attention.packed_documents(documents):  # what the text model's forward opens for a packed row
            return layer(x)

    our_time, our_out = timed(ours)
    return {"hf_packed": hf_time, "ours": our_time, "hf_packed_diff": (hf_packed - reference).abs().max().item(),
            "ours_diff": (our_out - reference).abs().max().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--part", choices=["step", "layer"], default="step")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_step(args) if args.part == "step" else _layer(args)))
        return
    runs = alternating_pairs(__file__, args.repeats, "--part", "step")
    layers = [run_worker_self(__file__, "0", "--part", "layer", OMP_NUM_THREADS="1") for _ in range(args.repeats)]
    lines = [f"# Qwen3.5-shaped hybrid model on CPU: {args.layers} layers (3 Gated DeltaNet : 1 gated attention), "
             f"hidden {args.hidden}, vocab {args.vocab}, batch {args.batch} x {args.seq} (one row a quarter padded), "
             f"fp32, one thread; {args.repeats} alternating process pairs, {args.steps} steps each (median after the "
             "first)", "", "## Training step", "", *paired_rows(runs), "",
             f"## The Gated DeltaNet layer alone, forward + backward on one packed row of documents {DOCS}", "",
             "| run | time (s, median of runs) | max abs output diff vs the documents as separate rows |",
             "|---|---|---|",
             f"| HF on the packed row | {statistics.median(r['hf_packed'] for r in layers):.4f} | "
             f"{max(r['hf_packed_diff'] for r in layers):.2e} |",
             f"| mindspeed_hf (documents as rows) | {statistics.median(r['ours'] for r in layers):.4f} | "
             f"{max(r['ours_diff'] for r in layers):.2e} |", "",
             f"ours / HF's packed forward, time: {spread([r['ours'] / r['hf_packed'] for r in layers])}"]
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
