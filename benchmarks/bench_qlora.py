"""QLoRA training steps (bitsandbytes 4-bit NF4 + double quant, prepare_model_for_kbit_training, gradient
checkpointing, LoRA r=8 on every linear layer, AdamW): step time and step peak memory, plain Hugging Face vs
mindspeed_hf, each run in its own process; the pair is repeated (alternately) and the ratios are reported as
median [min-max] over the repeats.

    python benchmarks/bench_qlora.py                                   # vocab 151936 (Qwen's), 4 layers, CPU
    python benchmarks/bench_qlora.py --repeats 3 --out benchmarks/results/qlora_cpu.md

The loop is a custom one, so the mindspeed_hf process runs with MINDSPEED_HF_KERNELS_SKIP_LOGITS=always (inside
Trainer the default `auto` skips the logits by itself). Step peak: on an accelerator the allocator peak over the
step minus what was allocated before it; on the CPU the process high-water mark (VmHWM, reset through
/proc/self/clear_refs before the step) minus the resident size before it, with large allocations mmapped
(MALLOC_MMAP_THRESHOLD_) so that freed memory leaves the resident set. The first step (it allocates the
gradients and optimizer state) is not measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from results_io import add_run_arguments, emit, paired_rows, run_worker_self

VARIANTS = {"plain HF": "0", "mindspeed_hf": "1"}


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _save_base(args: argparse.Namespace, path: str) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=max(1, args.heads // 2), head_dim=args.hidden // args.heads,
                         max_position_embeddings=max(4096, args.seq), tie_word_embeddings=False)
    Qwen3ForCausalLM(config).save_pretrained(path)


def _qlora(args: argparse.Namespace, device: str):
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(args.base, quantization_config=quantization, dtype=dtype,
                                                 device_map={"": device})
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=not args.no_checkpointing)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0,
                                             task_type="CAUSAL_LM"))
    return model.train()


def _worker(args: argparse.Namespace) -> None:
    import torch

    import mindspeed_hf  # enabled or not by MINDSPEED_HF_AUTO, set by the parent
    from mindspeed_hf.device import detect_device_type, device_module, peak_memory_bytes, reset_peak_memory

    torch.set_num_threads(args.threads)
    device = args.device or detect_device_type()
    accelerator = device_module(device)
    model = _qlora(args, device)
    if mindspeed_hf.is_enabled():
        mindspeed_hf.apply_to_model(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)

    losses, times, peaks = [], [], []
    for step in range(args.steps):
        if accelerator is not None:
            accelerator.synchronize()
            before = accelerator.memory_allocated()
            reset_peak_memory(device)
        else:
            before = _rss("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if accelerator is not None:
            accelerator.synchronize()
        seconds = time.perf_counter() - start
        peak = (peak_memory_bytes(device) if accelerator is not None else _rss("VmHWM")) - before
        losses.append(loss.item())
        if step:  # the first step allocates the gradients and optimizer state
            times.append(seconds)
            peaks.append(peak)
    print(json.dumps({"losses": losses, "step": statistics.median(times), "peak_bytes": max(peaks),
                      "report": mindspeed_hf.report(model)}))


def _run(args: argparse.Namespace, auto: str) -> dict:
    skip = {"MINDSPEED_HF_KERNELS_SKIP_LOGITS": "always"} if auto == "1" else {}
    return run_worker_self(__file__, auto, "--base", args.base, MALLOC_MMAP_THRESHOLD_="65536", **skip)


def _table(args: argparse.Namespace, runs: list[dict]) -> str:
    ours = runs[-1]["mindspeed_hf"]["report"]
    kernels = ", ".join(f"{k} x{v}" for k, v in ours["kernels"].items() if v)
    quantized = ours["quantized_linear"]
    header = (f"QLoRA (NF4, double quant, {args.dtype} compute, gradient checkpointing "
              f"{'off' if args.no_checkpointing else 'on'}, LoRA r=8 all-linear): Qwen3 shape, vocab {args.vocab}, "
              f"hidden {args.hidden}, {args.layers} layers, batch {args.batch} x {args.seq}, {args.steps} steps "
              f"(first not measured), {args.repeats} process pairs, {args.threads} torch threads; backend "
              f"{ours['backend']} ({kernels}); {quantized['modules']} quantized linears: "
              f"{quantized['implementation']}")
    return "\n".join([header, "", *paired_rows(runs, tuple(VARIANTS))]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="plain / mindspeed_hf process pairs, run alternately")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process")
    parser.add_argument("--no-checkpointing", action="store_true", help="prepare_model_for_kbit_training without it")
    parser.add_argument("--base", default=None, help=argparse.SUPPRESS)
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)

    with tempfile.TemporaryDirectory() as base:
        _save_base(args, base)
        args.base = base
        runs = [{name: _run(args, auto) for name, auto in VARIANTS.items()} for _ in range(args.repeats)]
    emit(_table(args, runs), args.out)


if __name__ == "__main__":
    main()
