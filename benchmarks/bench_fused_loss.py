"""Plain HF causal-LM loss vs the chunked fused linear cross-entropy: peak memory, step time, losses.

Model: Qwen3 architecture, 4 layers, vocab 151936, hidden 256, intermediate 768, 4 heads of 64 (2 KV heads),
untied lm_head (Qwen3Config's default), fp32 on the CPU; batch 2 x 1024 tokens, labels = input ids; AdamW
(lr 1e-4, weight decay 0.01, constant); 3 training steps of transformers.Trainer. Each variant runs in its own
subprocess (MINDSPEED_HF_AUTO=0 in both):
- plain: HF's own Qwen3ForCausalLM.forward (full logits, then ForCausalLMLoss);
- fused: mindspeed_hf enabled with only the fused loss on (the other kernels off), skip_logits auto: Trainer's
  own loss computation is where nothing reads the logits, so they are skipped there.
Peak memory is the subprocess's resident-set high-water mark (ru_maxrss), so it includes the interpreter, torch,
weights, gradients and AdamW state; step time is the median of the steps after the first.

    python benchmarks/bench_fused_loss.py [--repeats 2] [--sweep 128,256,512,1024] [--loop [--fsdp 2]] [--out F]

--loop: a custom training loop (`model(**batch).loss.backward()`, the same AdamW steps) instead of Trainer: outside
Trainer nothing marks the forward, and the logits are made on first read (never, here).
--fsdp N: that loop under FSDP2 on N CPU processes (torchrun, gloo; `fully_shard` on every decoder layer and on the
model, as a user's own loop does), each rank running the same per-device batch on its own rows (global batch N x 2);
peak memory is the largest rank's.
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
RESULT = ROOT / "benchmarks" / "results" / "fused_loss_cpu.md"
LOOP_RESULT = ROOT / "benchmarks" / "results" / "fused_loss_loop_cpu.md"
FSDP_RESULT = ROOT / "benchmarks" / "results" / "fused_loss_loop_fsdp_cpu.md"
SHAPE = dict(vocab_size=151936, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False)
BATCH, SEQ, STEPS = 2, 1024, 3


def worker(variant: str, chunk: int, threads: int, loop: bool = False, fsdp: int = 0) -> dict:
    """One measured run in this process, through transformers.Trainer (`loop`: a custom training loop, the same
    AdamW steps; `fsdp`: that loop as one of that many FSDP2 ranks); returns its numbers."""
    import tempfile

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Trainer, TrainingArguments

    import mindspeed_hf  # MINDSPEED_HF_AUTO=0: nothing is patched on import
    from mindspeed_hf.config import config_from_dict
    from mindspeed_hf.trainers import run_of

    if threads:
        torch.set_num_threads(threads)
    if variant == "fused":  # the loss alone (skip_logits: auto - Trainer's own loss computation skips them)
        off = dict.fromkeys(("rms_norm", "rope", "swiglu", "attention"), False)
        mindspeed_hf.enable(config_from_dict({"kernels": {**off, "loss_chunk_size": chunk}}))
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**SHAPE, attn_implementation="sdpa")).float()
    gen = torch.Generator().manual_seed(1)
    ranks = fsdp or 1  # each rank runs the same per-device batch, as Trainer's per_device_train_batch_size
    ids = torch.randint(0, SHAPE["vocab_size"], (BATCH * ranks, SEQ), generator=gen).tolist()
    rows = [{"input_ids": row, "labels": row} for row in ids] * STEPS
    losses, times = [], []

    class Measured(Trainer):
        def training_step(self, *args, **kwargs):
            start = time.perf_counter()
            loss = super().training_step(*args, **kwargs)
            losses.append(loss.item())
            times.append(time.perf_counter() - start)
            return loss

    if loop:  # `model(**batch).loss.backward()`: nothing reads the logits, nothing marks the forward for us
        import torch.utils.data

        rank = _shard(model) if fsdp else 0
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        loader = torch.utils.data.DataLoader(rows, batch_size=BATCH * ranks, collate_fn=lambda b: {
            k: torch.tensor([r[k] for r in b[rank * BATCH:(rank + 1) * BATCH]]) for k in b[0]})
        rss_init = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        model.train()
        for batch in loader:
            start = time.perf_counter()
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(_across_ranks(loss.detach(), "avg") if fsdp else loss.item())
            times.append(time.perf_counter() - start)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if fsdp:  # the largest rank's
            peak, rss_init = (int(_across_ranks(torch.tensor(float(v)), "max")) for v in (peak, rss_init))
        return {"variant": variant, "chunk": chunk, "threads": torch.get_num_threads(), "losses": losses,
                "times": times, "peak_bytes": peak * 1024, "init_bytes": rss_init * 1024}

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-4,
                                 lr_scheduler_type="constant", weight_decay=0.01, report_to="none", save_strategy="no",
                                 disable_tqdm=True, use_cpu=True, seed=0, dataloader_pin_memory=False)
        trainer = Measured(model=model, args=args, train_dataset=rows)
        if variant == "fused":
            assert run_of(trainer).report["skip_logits"] == "auto"
        rss_init = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"variant": variant, "chunk": chunk, "threads": torch.get_num_threads(), "losses": losses,
            "times": times, "peak_bytes": peak * 1024, "init_bytes": rss_init * 1024}


def _shard(model) -> int:
    """FSDP2 as a user's loop applies it (every decoder layer, then the model) on a gloo group; returns the rank."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return dist.get_rank()


def _across_ranks(value, op: str) -> float:
    import torch.distributed as dist

    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return value.item() / (1 if op == "max" else dist.get_world_size())


def run_worker(variant: str, chunk: int, threads: int, loop: bool = False, fsdp: int = 0) -> dict:
    path = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, "MINDSPEED_HF_AUTO": "0", "PYTHONPATH": path}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={fsdp}"] if fsdp \
        else [sys.executable]
    cmd = [*launch, __file__, "--worker", variant, "--chunk", str(chunk), "--threads", str(threads),
           *(["--loop"] if loop else []), *(["--fsdp", str(fsdp)] if fsdp else [])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} worker failed:\n{done.stderr[-4000:]}")
    result = json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("{")))
    print(json.dumps(result), file=sys.stderr, flush=True)  # progress, and the raw numbers
    return result


def _step_time(runs: list[dict]) -> float:
    return statistics.median(t for run in runs for t in run["times"][1:])


def _spread(runs: list[dict]) -> str:
    steps = [t for run in runs for t in run["times"][1:]]
    return f"{min(steps):.2f}..{max(steps):.2f} s"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def table(plain: list[dict], fused: list[dict]) -> str:
    p_peak, f_peak = max(r["peak_bytes"] for r in plain), max(r["peak_bytes"] for r in fused)
    p_time, f_time = _step_time(plain), _step_time(fused)
    diff = max(abs(a - b) for a, b in zip(plain[0]["losses"], fused[0]["losses"]))
    fmt = lambda losses: ", ".join(f"{x:.6f}" for x in losses)  # noqa: E731
    return "\n".join([
        "| | plain HF | fused loss | fused / plain |",
        "|---|---|---|---|",
        f"| peak memory (ru_maxrss of the subprocess) | {_gb(p_peak)} | {_gb(f_peak)} | {f_peak / p_peak:.2f}x |",
        f"| resident after the model and Trainer are built | {_gb(plain[0]['init_bytes'])} | "
        f"{_gb(fused[0]['init_bytes'])} | |",
        f"| step time (median of steps 2..{STEPS}, all repeats) | {p_time:.2f} s | {f_time:.2f} s | "
        f"{f_time / p_time:.2f}x |",
        f"| step-time spread (min..max of those steps) | {_spread(plain)} | {_spread(fused)} | |",
        f"| losses per step | {fmt(plain[0]['losses'])} | {fmt(fused[0]['losses'])} | max abs diff {diff:.1e} |",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["plain", "fused"])
    parser.add_argument("--chunk", type=int, default=0, help="fused chunk rows (0 = the default from the vocab)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (0 = torch's default)")
    parser.add_argument("--repeats", type=int, default=2, help="plain/fused pairs, run alternately")
    parser.add_argument("--sweep", default="", help="comma-separated chunk sizes to time as extra fused runs")
    parser.add_argument("--loop", action="store_true", help="a custom training loop instead of Trainer")
    parser.add_argument("--fsdp", type=int, default=0, help="--loop under FSDP2 on this many CPU processes")
    parser.add_argument("--out", default=None, help=f"default {RESULT} ({LOOP_RESULT} with --loop, {FSDP_RESULT} "
                        "with --fsdp)")
    args = parser.parse_args()
    if args.worker:
        result = worker(args.worker, args.chunk, args.threads, args.loop, args.fsdp)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result))
        return
    if args.fsdp and not args.loop:
        parser.error("--fsdp measures the custom loop: add --loop")
    args.out = args.out or str(FSDP_RESULT if args.fsdp else LOOP_RESULT if args.loop else RESULT)

    plain, fused = [], []
    for _ in range(args.repeats):  # alternate so that load from other processes hits both alike
        plain.append(run_worker("plain", 0, args.threads, args.loop, args.fsdp))
        fused.append(run_worker("fused", args.chunk, args.threads, args.loop, args.fsdp))
    for run in plain[1:] + fused[1:]:
        assert run["losses"] == (plain if run["variant"] == "plain" else fused)[0]["losses"], "not deterministic"
    text = table(plain, fused)
    os.environ["MINDSPEED_HF_AUTO"] = "0"  # importing the package here must not patch anything
    sys.path.insert(0, str(ROOT))
    from mindspeed_hf.ops.fused_linear_cross_entropy import default_chunk_size

    chunk = args.chunk or default_chunk_size(SHAPE["vocab_size"])
    lines = [
        "# Fused linear cross-entropy vs plain HF loss (CPU, fp32)",
        "",
        f"Qwen3 architecture: {SHAPE['num_hidden_layers']} layers, vocab {SHAPE['vocab_size']}, hidden "
        f"{SHAPE['hidden_size']}, intermediate {SHAPE['intermediate_size']}, {SHAPE['num_attention_heads']} heads x "
        f"{SHAPE['head_dim']} ({SHAPE['num_key_value_heads']} KV), untied lm_head; batch {BATCH} x {SEQ} tokens, "
        f"AdamW, {STEPS} {'custom-loop' if args.loop else 'Trainer'} steps"
        f"{f' under FSDP2 on {args.fsdp} processes, {BATCH} rows each (peak: the largest rank)' if args.fsdp else ''}, "
        f"{args.repeats} plain/fused subprocess pairs run alternately; torch threads "
        f"{plain[0]['threads']}; fused chunk {chunk} rows. Peak memory is ru_maxrss of each subprocess (interpreter, "
        "weights, grads and AdamW state included). The machine's 2 cores are shared with other jobs, so step "
        "times of identical runs vary (see the spread row); peak memory and losses do not.",
        "",
        text,
    ]
    if args.sweep:
        lines += ["", "Chunk-size sweep (fused, one subprocess each):", "", "| chunk rows | peak memory | step time |",
                  "|---|---|---|"]
        for size in (int(s) for s in args.sweep.split(",")):
            run = run_worker("fused", size, args.threads)
            lines.append(f"| {size} | {_gb(run['peak_bytes'])} | {_step_time([run]):.2f} s |")
    report = "\n".join(lines) + "\n"
    print(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
