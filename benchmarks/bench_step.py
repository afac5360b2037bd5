"""Time training steps and measure peak memory: plain Hugging Face vs mindspeed_hf, each in its own process of
one run, side by side. Prints a markdown table with the ratios and the per-step loss difference.

    python benchmarks/bench_step.py --model-type qwen3 --vocab 32000 --hidden 512 --layers 4 --seq 512

Peak memory is the allocator peak on an accelerator and the process's resident high-water mark on the CPU
(so the CPU figure includes the Python/torch baseline of ~0.3-0.5 GB in both columns); on the CPU also the exact
tensor memory at the peak of one more, profiled step (tensor_memory.py: the CPU analogue of the allocator peak).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = {"plain HF": "0", "mindspeed_hf": "1"}


def _worker(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import mindspeed_hf  # enabled or not by MINDSPEED_HF_AUTO, set by the parent
    from mindspeed_hf.device import detect_device_type, peak_memory_bytes, reset_peak_memory

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tensor_memory import TensorPeak

    device = args.device or detect_device_type()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        args.model_type, vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2),
        head_dim=args.hidden // args.heads, max_position_embeddings=max(4096, args.seq), tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype)
    if mindspeed_hf.is_enabled():
        mindspeed_hf.apply_to_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    reset_peak_memory(device)

    def step() -> float:
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    losses, times = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        losses.append(step())
        if device != "cpu":
            getattr(torch, device).synchronize()
        times.append(time.perf_counter() - start)
    tensor_bytes = None
    if device == "cpu":  # one more step, profiled (not timed): its tensor memory exactly
        with TensorPeak() as measured:
            step()
        tensor_bytes = measured.bytes
    print(json.dumps({"losses": losses, "times": times, "peak_bytes": peak_memory_bytes(device),
                      "tensor_bytes": tensor_bytes, "report": mindspeed_hf.report(model)}))


def _run(args: argparse.Namespace, auto: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", *sys.argv[1:]]
    env = {**os.environ, "MINDSPEED_HF_AUTO": auto}
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-type", default="qwen3")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--device", default=None, help="cpu, cuda or npu (default: what is here)")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)

    results = {name: _run(args, auto) for name, auto in VARIANTS.items()}
    base, ours = results["plain HF"], results["mindspeed_hf"]
    step = {name: statistics.median(r["times"][1:] or r["times"]) for name, r in results.items()}
    diff = max(abs(a - b) for a, b in zip(base["losses"], ours["losses"], strict=True))
    tensors_head = (" tensor memory at a step's peak (MB, exact: tensor_memory.py) |"
                    if base["tensor_bytes"] is not None else "")
    kernels = ", ".join(f"{k} x{v}" for k, v in ours["report"]["kernels"].items() if v)
    lines = [
        f"{args.model_type}: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, batch {args.batch} x "
        f"{args.seq}, {args.dtype}, {args.steps} steps, backend {ours['report']['backend']} ({kernels})",
        "",
        "| run | step time (s, median) | peak memory (MB) |" + tensors_head + " losses |",
        "|---|---|---|" + "---|" * bool(tensors_head) + "---|",
    ]
    for name, r in results.items():
        losses = " ".join(f"{x:.6f}" for x in r["losses"])
        tensors = f" {r['tensor_bytes'] / 2**20:.3f} |" if tensors_head else ""
        lines.append(f"| {name} | {step[name]:.3f} | {r['peak_bytes'] / 2**20:.0f} |{tensors} {losses} |")
    tensor_ratio = f"tensor-memory peak ratio {ours['tensor_bytes'] / base['tensor_bytes']:.4f}x, " if tensors_head \
        else ""
    lines += [
        "",
        f"step time ratio {step['mindspeed_hf'] / step['plain HF']:.2f}x, "
        f"peak memory ratio {ours['peak_bytes'] / base['peak_bytes']:.2f}x, {tensor_ratio}max |loss diff| {diff:.2e}",
    ]
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
