"""Tokens/s and peak memory of whole training steps through transformers.Trainer on realistic model shapes (random
weights, packed sequences): plain Hugging Face, HF + Liger (`use_liger_kernel=True`) and mindspeed_hf, each in its
own process, as ratios to plain HF in one markdown table. benchmarks/gpu_check.sh runs it on a CUDA GPU:

    python benchmarks/bench_gpu_models.py --device cuda --dtype bf16 --seq 4096 --out gpu_table.md

`--tiny` shrinks every shape (and the sequence) so the same code paths run on a CPU in seconds (the dry run).
A variant whose library is missing (liger-kernel) is skipped with a message; a variant that fails is a table row
saying so, and the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from results_io import emit  # benchmarks/, beside this script

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("plain HF", "HF + Liger", "mindspeed_hf")
#: Qwen3-0.6B's published shape, and Qwen3-30B-A3B's layer shape with 4 of its 48 layers (fits one GPU with AdamW).
SHAPES = {
    "qwen3_0_6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6),
    "qwen3_moe_30b_a3b_4layers": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=4,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=40960,
        rms_norm_eps=1e-6),
}
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            max_position_embeddings=1024)


def shape_config(name: str, tiny: bool) -> dict:
    """The config values of shape `name` (shrunk with `tiny`; keys a family does not use are dropped)."""
    values = dict(SHAPES[name])
    if tiny:
        values.update({k: v for k, v in TINY.items() if k in values})
    return values


def packed_rows(vocab: int, seq: int, rows: int, seed: int = 0) -> list[dict]:
    """`rows` rows of `seq` tokens, each several documents packed back to back: position_ids restart at every
    document and the first token of each is not a target (HF's DataCollatorWithFlattening convention)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        lengths: list[int] = []
        while sum(lengths) < seq:
            lengths.append(min(seq - sum(lengths), int(torch.randint(seq // 8, seq // 2 + 1, (1,), generator=gen))))
        ids = torch.randint(0, vocab, (seq,), generator=gen)
        positions = torch.cat([torch.arange(n) for n in lengths])
        labels = ids.clone()
        labels[positions == 0] = -100
        out.append({"input_ids": ids, "labels": labels, "position_ids": positions})
    return out


def worker(variant: str, shape: str, args: argparse.Namespace) -> dict:
    """One variant's run in this process; returns its measurements."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    import mindspeed_hf  # enabled by MINDSPEED_HF_AUTO=1 (mindspeed_hf variant) or not (the others)
    from mindspeed_hf.device import peak_memory_bytes, reset_peak_memory

    device, dtype = args.device, {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    values = shape_config(shape, args.tiny)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    rows = packed_rows(config.vocab_size, args.seq, args.warmup + args.steps)
    sync = getattr(torch, device).synchronize if device != "cpu" else (lambda: None)

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: dict[int, float] = {}
            self._start = 0.0

        def on_train_begin(self, a, state, control, **kwargs):
            reset_peak_memory(device)

        def on_step_begin(self, a, state, control, **kwargs):
            sync()
            self._start = time.perf_counter()

        def on_step_end(self, a, state, control, **kwargs):
            sync()
            self.times.append(time.perf_counter() - self._start)

        def on_log(self, a, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses[state.global_step] = float(logs["loss"])

    timer = Timer()
    training = TrainingArguments(
        output_dir=str(Path(args.workdir) / f"{shape}_{variant.replace(' ', '_')}"), max_steps=len(rows),
        per_device_train_batch_size=1, learning_rate=1e-5, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, use_liger_kernel=variant == "HF + Liger", dataloader_pin_memory=device != "cpu",
        use_cpu=device == "cpu", seed=0)
    trainer_cls = mindspeed_hf.MindSpeedTrainer if variant == "mindspeed_hf" else Trainer
    trainer = trainer_cls(model=model, args=training, train_dataset=rows, callbacks=[timer],
                          data_collator=lambda batch: {k: torch.stack([r[k] for r in batch]) for k in batch[0]})
    trainer.train()
    step = statistics.median(timer.times[args.warmup:])
    return {"tokens_per_s": args.seq / step, "step_s": step, "peak_bytes": peak_memory_bytes(device),
            "losses": timer.losses, "params": sum(p.numel() for p in model.parameters())}


def run_variant(variant: str, shapes: list[str], argv: list[str]) -> dict[str, dict]:
    """`variant` of every shape in its own process (patches never leak between variants): shape -> measurements,
    or {"error": ...} for every shape when the process fails."""
    env = {**os.environ, "MINDSPEED_HF_AUTO": "1" if variant == "mindspeed_hf" else "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, __file__, *argv, "--worker", variant]
    print(f"[bench_gpu_models] {variant}: {', '.join(shapes)}", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        print(proc.stderr[-3000:], file=sys.stderr)
        return {shape: {"error": f"failed (exit {proc.returncode}): {tail}"} for shape in shapes}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def liger_importable() -> bool:
    """liger-kernel (and triton under it) imports here."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception:  # ImportError, or triton failing without a GPU
        return False
    return True


def shape_table(shape: str, runs: dict[str, dict], args: argparse.Namespace) -> str:
    """Markdown rows of one shape: each variant's tokens/s and peak memory, as ratios to plain HF."""
    base = runs.get("plain HF", {})
    lines = [f"### {shape}{' (tiny)' if args.tiny else ''}: {args.dtype}, 1 x {args.seq} packed, "
             f"median of {args.steps} timed step(s) after {args.warmup}", "",
             "| | tokens/s | vs plain HF | peak memory (GiB) | vs plain HF | max loss diff vs plain HF |",
             "|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        run = runs.get(variant)
        if run is None or "error" in run or "skipped" in run:
            lines.append(f"| {variant} | {(run or {}).get('error') or (run or {}).get('skipped', 'not run')} |||||")
            continue
        tps = f"{run['tokens_per_s'] / base['tokens_per_s']:.2f}x" if "tokens_per_s" in base else ""
        mem = f"{run['peak_bytes'] / base['peak_bytes']:.2f}x" if base.get("peak_bytes") else ""
        steps = set(run["losses"]) & set(base.get("losses", {}))
        diff = max((abs(run["losses"][s] - base["losses"][s]) for s in steps), default=None)
        lines.append(f"| {variant} | {run['tokens_per_s']:,.0f} | {tps} | {run['peak_bytes'] / 2**30:.2f} | {mem} | "
                     f"{'' if diff is None else f'{diff:.2e}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "npu", "cpu"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=8, help="timed steps (median step time)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated from {', '.join(SHAPES)}")
    parser.add_argument("--tiny", action="store_true", help="shrink every shape: a CPU dry run of the code paths")
    parser.add_argument("--workdir", default="/tmp/bench_gpu_models")
    parser.add_argument("--out", default=None, help="write the markdown table here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(raw)
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    if args.worker:
        print(json.dumps({shape: worker(args.worker, shape, args) for shape in shapes}))
        return 0
    liger = liger_importable()
    if not liger:
        print("[bench_gpu_models] liger-kernel not importable here: the HF + Liger column is skipped", flush=True)
    skipped = {shape: {"skipped": "skipped: liger-kernel not importable"} for shape in shapes}
    runs = {v: skipped if v == "HF + Liger" and not liger else run_variant(v, shapes, raw) for v in VARIANTS}
    parts = [f"## plain HF vs HF + Liger vs mindspeed_hf, {args.device}, Trainer, random weights"]
    parts += [shape_table(shape, {v: runs[v][shape] for v in VARIANTS}, args) for shape in shapes]
    emit("\n\n".join(parts) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
