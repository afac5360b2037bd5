"""Per-rank memory of parameters + gradients + AdamW state: FSDP2 over N processes vs one process.

    python benchmarks/bench_fsdp_memory.py            # 2 processes (gloo, CPU) vs 1, ~21M-param Qwen3
    python benchmarks/bench_fsdp_memory.py --nproc 4

Memory is counted as tensor bytes (the local shard storage of every parameter, gradient and
optimizer state tensor after one AdamW step), which is exact and independent of allocator noise.
The single-process baseline is the same model without FSDP, as a user runs it today. Prints a
markdown table and the ratio (target: <= 0.6x at 2 processes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("MINDSPEED_HF_AUTO", "0")

REPO = Path(__file__).resolve().parents[1]


def model_config(args):
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=args.hidden, intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
        vocab_size=args.vocab, num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
        max_position_embeddings=256,
    )


def one_step(model, rank: int, world: int, scale: float) -> tuple:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2 * world, 64), generator=g)[2 * rank : 2 * rank + 2]
    loss = model(input_ids=ids, labels=ids).loss
    (loss * scale).backward()
    opt.step()  # grads kept: we count them
    return opt, loss.item()


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from mindspeed_hf.device import peak_memory_bytes
    from mindspeed_hf.parallel import ParallelDims, apply_fsdp, fsdp_mesh, init_distributed, local_state_bytes

    torch.set_num_threads(1)
    device = init_distributed("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(args)).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    if args.fsdp:
        dims = ParallelDims(world_size=world)
        apply_fsdp(model, fsdp_mesh(dims.build_mesh(device.type), dims))
    opt, loss = one_step(model, rank, world, scale=float(world))
    stats = local_state_bytes(model, opt)
    stats.update(rank=rank, loss=loss, n_params=n_params, peak_rss=peak_memory_bytes("cpu"))
    _gather_to_file(stats, world, args.out)


def _gather_to_file(stats: dict, world: int, out: str) -> None:
    """Every rank's stats into one JSON file (written by rank 0), then leave the process group."""
    import torch.distributed as dist

    gathered = [None] * world
    dist.all_gather_object(gathered, stats)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def _proc_status() -> dict[str, int]:
    """VmHWM / VmRSS / RssAnon / RssFile of this process in bytes (Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def load_worker(args) -> None:
    """Host memory while loading a checkpoint: from_pretrained (1 process) vs sharded loading."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from mindspeed_hf.parallel import (
        ParallelDims,
        build_meta_model,
        from_pretrained_sharded,
        fsdp_mesh,
        init_distributed,
        local_state_bytes,
    )

    torch.set_num_threads(1)
    device = init_distributed("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = ParallelDims(world_size=world)
    mesh = fsdp_mesh(dims.build_mesh(device.type), dims)
    build_meta_model(AutoConfig.from_pretrained(args.load))  # warm the imports out of the window
    with open("/proc/self/clear_refs", "w") as f:  # restart the VmHWM high-water mark
        f.write("5")
    before = _proc_status()
    if args.fsdp:
        model = from_pretrained_sharded(args.load, mesh)
    else:  # its tensors may be lazy views of the mmap'd file: read them once, as training will
        model = AutoModelForCausalLM.from_pretrained(args.load)
        torch.stack([p.detach().float().sum() for p in model.parameters()]).sum().item()
    after = _proc_status()
    stats = {
        "rank": rank,
        "peak_growth": after["VmHWM"] - before["VmRSS"],
        "rss_growth": after["VmRSS"] - before["VmRSS"],
        "params": local_state_bytes(model)["params"],
    }
    _gather_to_file(stats, world, args.out)


def launch(nproc: int, fsdp: bool, args, out: Path, load: str | None = None) -> list[dict]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        __file__, "--worker", "--out", str(out), "--hidden", str(args.hidden), "--layers", str(args.layers),
        "--vocab", str(args.vocab),
    ] + (["--fsdp"] if fsdp else []) + (["--load", load] if load else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", MINDSPEED_HF_AUTO="0", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    subprocess.run(cmd, env=env, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fsdp", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--load", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        load_worker(args) if args.load else worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = launch(1, False, args, Path(tmp) / "base.json")[0]
        shards = launch(args.nproc, True, args, Path(tmp) / "fsdp.json")
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        ckpt = str(Path(tmp) / "ckpt")
        AutoModelForCausalLM.from_config(model_config(args)).save_pretrained(ckpt)
        load_base = launch(1, False, args, Path(tmp) / "load_base.json", load=ckpt)[0]
        load_shards = launch(args.nproc, True, args, Path(tmp) / "load_fsdp.json", load=ckpt)
    print(f"model: Qwen3, {base['n_params'] / 1e6:.1f}M params, fp32, AdamW, after one step (MiB)\n")
    print("| run | rank | params | grads | optim state | total | vs 1 process |")
    print("|---|---|---|---|---|---|---|")
    print(f"| 1 process | 0 | {mib(base['params'])} | {mib(base['grads'])} | {mib(base['optim'])} "
          f"| {mib(base['total'])} | 1.00x |")
    for s in shards:
        print(f"| FSDP2 x{args.nproc} | {s['rank']} | {mib(s['params'])} | {mib(s['grads'])} | "
              f"{mib(s['optim'])} | {mib(s['total'])} | {s['total'] / base['total']:.2f}x |")
    worst = max(s["total"] for s in shards) / base["total"]
    print(f"\nper-rank params+grads+optimizer state ratio, FSDP2 x{args.nproc} / 1 process: {worst:.3f}x "
          f"(target <= 0.6x at 2 processes: {'PASS' if worst <= 0.6 else 'FAIL'})")
    print(f"process peak RSS (MiB, includes torch/transformers): 1 process {mib(base['peak_rss'])}, "
          f"FSDP2 ranks {[mib(s['peak_rss']) for s in shards]}")
    print("\nloading the checkpoint (MiB; RSS counts the mmap'd safetensors pages a process touched):\n")
    print("| run | rank | peak RSS growth | RSS growth after load | params held |")
    print("|---|---|---|---|---|")
    rows = [("from_pretrained, 1 process", load_base)]
    rows += [(f"from_pretrained_sharded x{args.nproc}", s) for s in load_shards]
    for label, s in rows:
        print(f"| {label} | {s['rank']} | {mib(s['peak_growth'])} | {mib(s['rss_growth'])} | {mib(s['params'])} |")


if __name__ == "__main__":
    main()
