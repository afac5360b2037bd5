"""The fused loss on a tensor-parallel lm_head, 2 CPU processes (gloo): vocab-parallel vs gathered chunks.

    python benchmarks/bench_vocab_parallel_loss.py          # launches itself under torchrun (2 processes)
    python benchmarks/bench_vocab_parallel_loss.py --out benchmarks/results/vocab_parallel_loss_cpu.md

A llama built by `parallel.parallelize` with tp=2 (its lm_head a DTensor Shard(0) over the vocabulary, HF's
colwise_gather_output plan); the same final hidden states (`--batch` rows of `--seq` tokens, identical on both tp
ranks) and targets go through `fused_linear_cross_entropy` twice per round, forward and backward:
  * vocab-parallel (what the loss does for such a head): each rank scores its own vocabulary slice, the [chunk,
    vocab / tp] logits never leave the rank; three [chunk] vectors are all-reduced per chunk;
  * gathered (what it did before, and still does for a head it must call, e.g. LoRA on lm_head): the head called as a
    module per chunk, its [chunk, vocab] logits all-gathered over tp, the ordinary cross-entropy on them.
Time: medians over interleaved rounds and the spread of the per-round ratios; the losses and hidden-state gradients
of the two compared; logits bytes per chunk from the shapes (fp32).
"""

from __future__ import annotations

import os
import statistics

os.environ.setdefault("MINDSPEED_HF_AUTO", "0")
KINDS = ("vocab_parallel", "gathered")


def model_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                       num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=2 * args.seq, tie_word_embeddings=False, use_cache=False)


def _called(head):
    """The same head as a module the loss must call (not an nn.Linear of its own): the gathered path."""
    from torch import nn

    class CalledHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head, self.out_features = head, head.out_features

        def forward(self, hidden):
            return self.head(hidden)

    return CalledHead()


def worker(args) -> None:
    import torch
    from results_io import interleaved_times, write_result
    from transformers import AutoModelForCausalLM

    from mindspeed_hf.config import MindSpeedConfig, ParallelConfig
    from mindspeed_hf.ops.fused_linear_cross_entropy import default_chunk_size, fused_linear_cross_entropy
    from mindspeed_hf.parallel import ParallelDims, init_distributed, parallelize

    torch.set_num_threads(1)
    init_distributed("cpu")
    dims = ParallelDims(dp_shard=1, tp=2, world_size=2)
    dims.build_mesh("cpu")
    model = parallelize(AutoModelForCausalLM.from_pretrained(args.model_dir), dims,
                        MindSpeedConfig(parallel=ParallelConfig(dp_shard=1, tp=2)))
    gen = torch.Generator().manual_seed(0)
    rows = args.batch * args.seq
    hidden = torch.randn(rows, args.hidden, generator=gen).requires_grad_()
    target = torch.randint(0, args.vocab, (rows,), generator=gen)
    heads = {"vocab_parallel": model.lm_head, "gathered": _called(model.lm_head)}
    seen = {}

    def step(kind: str) -> None:
        hidden.grad = None
        loss = fused_linear_cross_entropy(hidden, heads[kind], None, shift_labels=target)
        loss.backward()
        seen[kind] = (loss.item(), hidden.grad.clone())

    times = interleaved_times(list(KINDS), args.rounds, args.steps, step)
    (loss_a, grad_a), (loss_b, grad_b) = seen["vocab_parallel"], seen["gathered"]
    write_result(args.result, {"times": times, "loss_diff": abs(loss_a - loss_b),
                               "grad_diff": (grad_a - grad_b).abs().max().item(),
                               "chunk": default_chunk_size(args.vocab)})


def table(result: dict, args) -> str:
    times, chunk = result["times"], result["chunk"]
    fast, slow = (statistics.median(times[k]) for k in KINDS)
    ratios = [a / b for a, b in zip(times["vocab_parallel"], times["gathered"], strict=True)]
    chunk_mib = chunk * args.vocab * 4 / (1 << 20)  # fp32 [chunk, vocab]
    return "\n".join([
        f"llama lm_head, hidden {args.hidden}, vocabulary {args.vocab}, tp=2 on 2 CPU processes (gloo), "
        f"{args.batch} x {args.seq} rows, fp32, chunks of {chunk} rows, {args.rounds} rounds of {args.steps} "
        "loss forward + backward",
        "", "| loss on the tp lm_head | seconds (median of rounds) | a chunk's scored logits per rank (MiB, shapes) |",
        "|---|---|---|",
        f"| gathered (the head called, [chunk, vocab] all-gathered) | {slow:.4f} | {chunk_mib:.2f} |",
        f"| vocab-parallel (mindspeed_hf) | {fast:.4f} | {chunk_mib / 2:.2f} |",
        f"| ratio | {fast / slow:.2f}x (round ratios {min(ratios):.2f}..{max(ratios):.2f}) | 0.50x |",
        "", f"loss diff {result['loss_diff']:.2e}, hidden-gradient max diff {result['grad_diff']:.2e}"])


def main() -> None:
    from results_io import torchrun_main, torchrun_parser

    ap = torchrun_parser(__doc__.splitlines()[0], hidden=256, layers=1, batch=8, seq=512, steps=2, rounds=6)
    ap.add_argument("--vocab", type=int, default=32768)
    torchrun_main(__file__, ap, worker, model_config, table)


if __name__ == "__main__":
    main()
