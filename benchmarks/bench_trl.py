"""TRL's SFTTrainer and DPOTrainer (trl >= 1.15: the loss from TRL's own chunked LM head, add_fused_lm_head), plain
TRL vs TRL with `import mindspeed_hf`: peak memory, step time, the per-step losses and every metric TRL logs.

Model: Qwen3 architecture, `--layers` layers, hidden `--hidden`, vocabulary `--vocab` (untied lm_head), fp32
weights (TRL's configs default to bf16 autocast); rows of `--seq` tokens (prompt and completion halves; DPO: a prompt
with a chosen and a rejected completion) from the shipped word-level tokenizer; `--batch` rows per step, `--steps`
steps, each trainer with its own defaults (TRL's gradient checkpointing on: mindspeed_hf applies it as its full
recompute). Each variant runs in its own process (MINDSPEED_HF_AUTO=0 / 1, one thread), the pairs alternating.
Peak memory is the process's resident high-water mark (ru_maxrss: start-up and imports included, so mindspeed_hf's
own import shows there) on CPU, with the resident set's growth while training (sampled every 2 ms from the trainer
built), the C heap in use at its peak (glibc mallinfo2, sampled the same way: tensors and larger Python objects,
without the freed memory the allocator keeps) and, exactly, the tensor memory at the last step's peak
(tensor_memory.py: what was live at its start plus the profiler's allocations inside it, the CPU analogue of a
device's peak allocation; that step is left out of the step time); torch's peak allocation on a GPU / NPU.

    python benchmarks/bench_trl.py [--trainer sft|dpo|both] [--repeats 2] [--out benchmarks/results/trl_cpu.md]

With the accelerator TRL's head still computes the loss (it is installed on the model instance after the trainer is
built; our fused loss stays out of it, the end-of-train line says so); the backbone runs our kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from results_io import emit, spread  # noqa: E402
from tensor_memory import TensorPeak  # noqa: E402


def _worker_run(auto: str, trainer: str) -> dict:
    """This script's worker for `trainer` (its other arguments this process's) with MINDSPEED_HF_AUTO=`auto`, one
    thread: the JSON object on the last line of its output."""
    import os
    import subprocess

    cmd = [sys.executable, __file__, "--worker", *sys.argv[1:], "--trainer", trainer]
    done = subprocess.run(cmd, env={**os.environ, "MINDSPEED_HF_AUTO": auto, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} (MINDSPEED_HF_AUTO={auto}) failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _rows(tokenizer, count: int, seq: int, trainer: str, seed: int = 1) -> list[dict[str, str]]:
    import random

    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha())  # (a fast tokenizer's dict order varies)
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    half = seq // 2 - 2
    if trainer == "sft":
        return [{"prompt": text(half), "completion": " " + text(half)} for _ in range(count)]
    return [{"prompt": text(half), "chosen": " " + text(half), "rejected": " " + text(half)} for _ in range(count)]


def _resident() -> int:
    """This process's resident set now (Linux), in bytes."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _heap_reader():
    """A function returning the bytes the C allocator has handed out and not yet had back (glibc mallinfo2: in-use
    heap chunks plus mmapped blocks): what the tensors and the larger Python objects hold, without the freed memory
    the allocator keeps (which the resident set counts, so its high-water mark also measures the allocator's
    fragmentation). None where the C library has no mallinfo2 (glibc < 2.33, other platforms)."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                         "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = MallInfo2

    def in_use() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    return in_use


def worker(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    import mindspeed_hf  # MINDSPEED_HF_AUTO decides whether this patches anything
    from mindspeed_hf.device import peak_memory_bytes, reset_peak_memory
    from mindspeed_hf.recipes.default_run import TOKENIZER_DIR

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=args.hidden // 4, max_position_embeddings=2 * args.seq, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model = Qwen3ForCausalLM(config).float()
    rows = _rows(tokenizer, args.batch * args.steps, args.seq, args.trainer)
    logged, times = [], []
    profiled = args.steps - 1 if device == "cpu" else None  # the last step: its tensor memory, exactly (CPU)
    measured = TensorPeak()

    class Timed(TrainerCallback):
        def on_step_begin(self, _args, state, *_, **__):
            if state.global_step == profiled:
                measured.__enter__()
            self.began = time.perf_counter()

        def on_step_end(self, _args, state, *_, **__):
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.began)
            if state.global_step - 1 == profiled:
                measured.__exit__(None, None, None)

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "loss" in logs:
                logged.append({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))})

    common = dict(output_dir=args.output_dir, per_device_train_batch_size=args.batch, max_steps=args.steps,
                  learning_rate=1e-4, lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no",
                  seed=0, use_cpu=device == "cpu", max_length=args.seq, dataloader_num_workers=0)
    if args.trainer == "sft":
        trainer = SFTTrainer(model=model, args=SFTConfig(**common), train_dataset=Dataset.from_list(rows),
                             processing_class=tokenizer, callbacks=[Timed()])
    else:
        import copy

        trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=DPOConfig(**common),
                             train_dataset=Dataset.from_list(rows),
                             processing_class=tokenizer, callbacks=[Timed()])
    reset_peak_memory(device)
    heap_in_use = _heap_reader()
    built, sampled, heap = _resident(), [0], [heap_in_use() if heap_in_use else None]
    done = threading.Event()

    def sample() -> None:  # the CPU's resident set while training (ru_maxrss also holds start-up and imports)
        while not done.wait(0.002):
            sampled[0] = max(sampled[0], _resident())
            if heap_in_use:
                heap[0] = max(heap[0], heap_in_use())

    sampler = threading.Thread(target=sample, daemon=True)
    if device == "cpu":
        sampler.start()
    trainer.train()
    done.set()
    if device == "cpu":
        sampler.join()
    ran = mindspeed_hf.report(trainer.model).get("ran", {}) if mindspeed_hf.is_enabled() else {}
    timed = (times[1:-1] if profiled is not None else times[1:]) or times  # the profiled step runs slower
    return {"losses": [entry["loss"] for entry in logged], "logs": logged, "step": statistics.median(timed),
            "peak_bytes": peak_memory_bytes(device), "ran": ran,
            "tensor_bytes": measured.bytes if profiled is not None else None,
            "train_bytes": (max(sampled[0], _resident()) - built) if device == "cpu" else None,
            "heap_bytes": heap[0] if device == "cpu" else None}


def _metrics_diff(plain: list[dict], ours: list[dict]) -> tuple[float, list[str]]:
    """The largest relative difference over every metric TRL logged at every step (and the metric names)."""
    worst, names = 0.0, []
    assert len(plain) == len(ours), (len(plain), len(ours))
    for a, b in zip(plain, ours):
        keys = sorted(set(a) - {"learning_rate", "epoch", "grad_norm"})
        assert keys == sorted(set(b) - {"learning_rate", "epoch", "grad_norm"}), (a.keys(), b.keys())
        names = keys
        for key in keys:
            worst = max(worst, abs(a[key] - b[key]) / max(abs(a[key]), 1e-6))
    return worst, names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", choices=["sft", "dpo", "both"], default="both")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default=None)
    parser.add_argument("--output_dir", default="/tmp/bench_trl_out")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    import trl

    lines = [f"# TRL {trl.__version__} trainers, plain vs `import mindspeed_hf`: Qwen3 architecture, {args.layers} "
             f"layers, hidden {args.hidden}, vocabulary {args.vocab} (untied), rows of {args.seq} tokens, batch "
             f"{args.batch}, {args.steps} steps, fp32 weights under TRL's default bf16 autocast, "
             f"{args.device or 'default device'}, one thread; {args.repeats} "
             "alternating process pairs", ""]
    for trainer in (("sft", "dpo") if args.trainer == "both" else (args.trainer,)):
        order = (("plain TRL", "0"), ("TRL + mindspeed_hf", "1"))
        runs = [{name: _worker_run(auto, trainer)
                 for name, auto in (order if repeat % 2 == 0 else order[::-1])} for repeat in range(args.repeats)]
        cpu = runs[0][order[0][0]]["train_bytes"] is not None
        lines += [f"## {trainer.upper()}", "", "| run | step time (s, median of pairs) | peak memory (MB, median of "
                  "pairs) |" + (" resident-set growth while training (MB, sampled every 2 ms, median) | heap in use "
                                "at its peak (MB, malloc, sampled every 2 ms, median) | tensor memory at the last "
                                "step's peak (MB, exact: live at its start + the profiler's allocations) |" if cpu
                                else "")
                  + " losses (first pair) |", "|---|---|---|" + ("---|---|---|" if cpu else "") + "---|"]
        for name, _ in order:
            step = statistics.median(r[name]["step"] for r in runs)
            peak = statistics.median(r[name]["peak_bytes"] for r in runs) / 2**20
            grew = (f" {statistics.median(r[name]['train_bytes'] for r in runs) / 2**20:.0f} |"
                    f" {statistics.median(r[name]['heap_bytes'] or 0 for r in runs) / 2**20:.0f} |"
                    f" {statistics.median(r[name]['tensor_bytes'] for r in runs) / 2**20:.3f} |") if cpu else ""
            losses = " ".join(f"{x:.6f}" for x in runs[0][name]["losses"])
            lines.append(f"| {name} | {step:.3f} | {peak:.0f} |{grew} {losses} |")
        plain, ours = (name for name, _ in order)
        worst, names = _metrics_diff(runs[0][plain]["logs"], runs[0][ours]["logs"])
        ran = runs[0][ours]["ran"]
        heap = (f", heap-in-use peak ratio {spread([r[ours]['heap_bytes'] / r[plain]['heap_bytes'] for r in runs])}"
                if cpu and all(r[name]["heap_bytes"] for r in runs for name in (plain, ours)) else "")
        if cpu:
            tensors = [r[ours]["tensor_bytes"] / r[plain]["tensor_bytes"] for r in runs]
            heap += f", tensor-memory peak ratio {spread(tensors, 4)}"
        lines += ["", f"step time ratio {spread([r[ours]['step'] / r[plain]['step'] for r in runs])}, peak memory "
                  f"ratio {spread([r[ours]['peak_bytes'] / r[plain]['peak_bytes'] for r in runs])}{heap}; every logged "
                  f"metric ({', '.join(names)}) equal within {worst:.1e} (relative, first pair); our kernels that "
                  f"ran: {', '.join(f'{k} {v}' for k, v in ran.items() if v)}", ""]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
