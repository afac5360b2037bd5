"""Tensor parallelism vs FSDP2 on 2 CPU processes (gloo): per-rank parameter memory and step time, tp=2 vs dp_shard=2.

    python benchmarks/bench_tensor_parallel.py                 # launches itself under torchrun (2 processes)
    python benchmarks/bench_tensor_parallel.py --out benchmarks/results/tensor_parallel_cpu.md

The same llama model and the same global batch (`--batch` rows of `--seq` tokens per step) on two layouts, both
built by `parallel.parallelize` in the same processes:
  * dp_shard=2 (FSDP2): each rank trains on half the rows; every parameter sharded, gathered whole per layer;
  * tp=2 (mindspeed_hf, sequence parallel): both ranks train on all rows; the projections, embeddings and lm_head
    sharded, the norms replicated; nothing is gathered whole.
Memory: bytes of the parameters, gradients and AdamW state this rank holds after one step (local shards, exact), and
the largest parameter bytes materialised at once during a forward (FSDP2: one layer gathered whole). Step time:
forward + backward + AdamW step, medians over interleaved rounds (dp, tp, tp, dp, ...), and the spread of the
per-round ratios. Plain Hugging Face forwards on both sides (kernels off), fp32.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

os.environ.setdefault("MINDSPEED_HF_AUTO", "0")
REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"dp_shard": {"dp_shard": 2}, "tp": {"dp_shard": 1, "tp": 2}}


def model_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 4,
                       num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=2 * args.seq, tie_word_embeddings=False, use_cache=False)


def _local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size()


def _build(kind: str, path: str):
    from transformers import AutoModelForCausalLM

    from mindspeed_hf.config import MindSpeedConfig, ParallelConfig
    from mindspeed_hf.parallel import ParallelDims, parallelize

    model = AutoModelForCausalLM.from_pretrained(path)
    dims = ParallelDims(**LAYOUTS[kind], world_size=2)
    dims.build_mesh("cpu")
    return parallelize(model, dims, MindSpeedConfig(parallel=ParallelConfig(**LAYOUTS[kind])))


def _rows(kind: str, rank: int, args):
    import torch

    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    half = args.batch // 2
    return ids if kind == "tp" else ids[rank * half:(rank + 1) * half]  # tp: every rank of the group, all rows


def _step(model, opt, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # gradients kept: counted


def _held(model, opt) -> dict[str, int]:
    params = list(model.parameters())
    state = [v for p in params for v in opt.state.get(p, {}).values() if getattr(v, "dim", lambda: 0)() > 0]
    return {"params": sum(_local_bytes(p) for p in params),
            "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            "optim": sum(_local_bytes(v) for v in state)}


def _watch_materialised(model) -> list[int]:
    """Parameter bytes of the first decoder layer while it computes (FSDP2: after its all-gather)."""
    seen: list[int] = []
    layer = model.model.layers[0]
    layer.register_forward_pre_hook(lambda m, a: seen.append(sum(_local_bytes(p) for p in m.parameters())))
    return seen


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from results_io import interleaved_times, write_result

    from mindspeed_hf.parallel import init_distributed

    torch.set_num_threads(1)
    init_distributed("cpu")
    rank = dist.get_rank()
    models = {kind: _build(kind, args.model_dir) for kind in LAYOUTS}
    opts = {kind: torch.optim.AdamW(m.parameters(), lr=1e-4) for kind, m in models.items()}
    result = {"memory": {}, "times": {kind: [] for kind in LAYOUTS}}
    for kind, model in models.items():
        seen = _watch_materialised(model)
        _step(model, opts[kind], _rows(kind, rank, args))  # also the warm-up
        result["memory"][kind] = {**_held(model, opts[kind]), "layer": seen[0]}
    rows = {kind: _rows(kind, rank, args) for kind in LAYOUTS}
    result["times"] = interleaved_times(list(LAYOUTS), args.rounds, args.steps,
                                        lambda kind: _step(models[kind], opts[kind], rows[kind]))
    write_result(args.result, result)

def table(result: dict, args) -> str:
    mem, times = result["memory"], result["times"]
    mib = 1 << 20
    total = {k: v["params"] + v["grads"] + v["optim"] for k, v in mem.items()}
    lines = [f"llama, {args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab}, 2 CPU processes (gloo), "
             f"global batch {args.batch} x {args.seq} per step, fp32, {args.rounds} rounds of {args.steps} steps",
             "", "| per rank | params (MiB) | params + grads + AdamW (MiB) | layer 0 materialised (MiB) |",
             "|---|---|---|---|"]
    for kind, label in (("dp_shard", "dp_shard=2 (FSDP2)"), ("tp", "tp=2 (mindspeed_hf)")):
        lines.append(f"| {label} | {mem[kind]['params'] / mib:.2f} | {total[kind] / mib:.2f} | "
                     f"{mem[kind]['layer'] / mib:.2f} |")
    lines.append(f"| ratio tp / dp_shard | {mem['tp']['params'] / mem['dp_shard']['params']:.2f}x | "
                 f"{total['tp'] / total['dp_shard']:.2f}x | {mem['tp']['layer'] / mem['dp_shard']['layer']:.2f}x |")
    tp, dp = (statistics.median(times[k]) for k in ("tp", "dp_shard"))
    ratios = [a / b for a, b in zip(times["tp"], times["dp_shard"], strict=True)]
    lines += ["", "| step time (median of rounds) | dp_shard=2 | tp=2 | ratio tp / dp_shard | ratio spread |",
              "|---|---|---|---|---|",
              f"| seconds per step | {dp:.4f} | {tp:.4f} | {tp / dp:.2f}x | {min(ratios):.2f}..{max(ratios):.2f} |"]
    return "\n".join(lines)


def main() -> None:
    from results_io import torchrun_main, torchrun_parser

    ap = torchrun_parser(__doc__.splitlines()[0], hidden=256, rounds=6)
    ap.add_argument("--vocab", type=int, default=4096)
    torchrun_main(__file__, ap, worker, model_config, table)


if __name__ == "__main__":
    main()
