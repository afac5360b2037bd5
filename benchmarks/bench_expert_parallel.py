"""Expert parallelism on 2 CPU processes (gloo): per-rank expert memory, and step time vs transformers' native EP.

    python benchmarks/bench_expert_parallel.py                 # launches itself under torchrun (2 processes)
    python benchmarks/bench_expert_parallel.py --out benchmarks/results/expert_parallel_cpu.md

Memory: tensor bytes this rank holds for the experts' parameters + gradients + AdamW state after one step (local
shards only; exact, no allocator noise), for the same Qwen3-MoE model
  * ep=1, replicated: every rank holds every expert (plain data parallel: what HF's Trainer runs on CPU);
  * ep=1, FSDP2 dp_shard=2: experts sharded by FSDP, all-gathered whole for each layer's compute;
  * ep=2 (mindspeed_hf): E/2 experts per rank, only those are ever materialised.
  * ep=2, transformers native (DistributedConfig(fsdp_size=2, ep_size=2)), for comparison.
"gathered" is the expert weight bytes one layer holds while it computes (after FSDP's all-gather), measured.
Step time: forward + backward + AdamW step, medians over interleaved rounds (ours, native, ours, ...), of
mindspeed_hf EP (parallelize with parallel.ep=2) and transformers' native EP (from_pretrained with
DistributedConfig(fsdp_size=2, ep_size=2)), same model, same batch, same process.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

os.environ.setdefault("MINDSPEED_HF_AUTO", "0")
REPO = Path(__file__).resolve().parents[1]


def model_config(args):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=args.hidden * 2, moe_intermediate_size=args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
        num_experts=args.experts, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
        tie_word_embeddings=False)


def _batch(rank: int, args):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (2 * args.batch, args.seq), generator=g)
    return ids[rank * args.batch:(rank + 1) * args.batch]


def _step(model, opt, ids) -> None:
    loss = model(input_ids=ids, labels=ids).loss
    (loss * 2).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # grads kept: counted


def _expert_bytes(model, opt) -> dict[str, int]:
    params = [p for n, p in model.named_parameters() if ".experts." in n]
    state = [v for p in params for v in opt.state.get(p, {}).values() if getattr(v, "dim", lambda: 0)() > 0]
    return {"params": sum(_local_bytes(p) for p in params),
            "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            "optim": sum(_local_bytes(v) for v in state)}


def _build(kind: str, path: str, args):
    import torch
    from transformers import AutoModelForCausalLM

    from mindspeed_hf.config import MindSpeedConfig, ParallelConfig
    from mindspeed_hf.parallel import ParallelDims, parallelize

    if kind == "native":
        from transformers import DistributedConfig

        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="grouped_mm",
                                                    distributed_config=DistributedConfig(fsdp_size=2, ep_size=2))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sizes = {"replicated": dict(dp_replicate=2, dp_shard=1), "fsdp": dict(dp_shard=2), "ep": dict(dp_shard=2, ep=2)}
    dims = ParallelDims(**sizes[kind], world_size=2)
    dims.build_mesh("cpu")
    return parallelize(model, dims, MindSpeedConfig(parallel=ParallelConfig(**sizes[kind])))


def _local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size()


def _watch_gathered(model) -> list[int]:
    """Bytes of expert weights the first experts module holds while it computes (after FSDP's all-gather)."""
    seen: list[int] = []
    experts = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
    experts.register_forward_pre_hook(
        lambda m, a: seen.append(_local_bytes(m.gate_up_proj) + _local_bytes(m.down_proj)))
    return seen


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from results_io import interleaved_times, write_result

    from mindspeed_hf.parallel import init_distributed

    torch.set_num_threads(1)
    init_distributed("cpu")
    rank = dist.get_rank()
    ids = _batch(rank, args)
    result = {"memory": {}, "times": {"ep": [], "native": []}}
    for kind in ("replicated", "fsdp", "ep", "native"):
        model = _build(kind, args.model_dir, args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gathered = _watch_gathered(model)
        _step(model, opt, ids)
        result["memory"][kind] = {**_expert_bytes(model, opt), "gathered": gathered[0]}
        del model, opt
    models = {kind: _build(kind, args.model_dir, args) for kind in ("ep", "native")}
    opts = {kind: torch.optim.AdamW(m.parameters(), lr=1e-4) for kind, m in models.items()}
    for kind in models:  # warm-up
        _step(models[kind], opts[kind], ids)
    result["times"] = interleaved_times(["ep", "native"], args.rounds, args.steps,
                                        lambda kind: _step(models[kind], opts[kind], ids))
    write_result(args.result, result)

def table(result: dict, args) -> str:
    mem = result["memory"]
    total = {k: v["params"] + v["grads"] + v["optim"] for k, v in mem.items()}
    mib = 1 << 20
    lines = [f"Qwen3-MoE, {args.layers} layers, hidden {args.hidden}, {args.experts} experts (top-2), 2 CPU processes "
             f"(gloo), batch {args.batch} x {args.seq} per rank, fp32",
             "", "| per rank, experts only | params + grads + AdamW (MiB) | ratio ep=2 / this | gathered per layer "
             "(MiB) | ratio ep=2 / this |", "|---|---|---|---|---|"]
    for kind, label in (("replicated", "ep=1, replicated"), ("fsdp", "ep=1, FSDP2 dp_shard=2"),
                        ("native", "ep=2, transformers native"), ("ep", "ep=2, mindspeed_hf")):
        lines.append(f"| {label} | {total[kind] / mib:.2f} | {total['ep'] / total[kind]:.2f}x | "
                     f"{mem[kind]['gathered'] / mib:.2f} | {mem['ep']['gathered'] / mem[kind]['gathered']:.2f}x |")
    ours, native = (statistics.median(result["times"][k]) for k in ("ep", "native"))
    ratios = [a / b for a, b in zip(result["times"]["ep"], result["times"]["native"])]
    lines += ["", "| step time (median of rounds) | mindspeed_hf EP | transformers native EP | ratio | ratio spread |",
              "|---|---|---|---|---|",
              f"| seconds per step | {ours:.4f} | {native:.4f} | {ours / native:.2f}x | "
              f"{min(ratios):.2f}..{max(ratios):.2f} |"]
    return "\n".join(lines)


def main() -> None:
    from results_io import torchrun_main, torchrun_parser

    ap = torchrun_parser(__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    torchrun_main(__file__, ap, worker, model_config, table)


if __name__ == "__main__":
    main()
