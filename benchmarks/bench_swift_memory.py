"""ms-swift's `swift sft` step memory: plain, with `import mindspeed_hf` (the fused loss; its token accuracy,
`outputs.logits.argmax(-1)`, read chunk by chunk without the logits), and with the accelerator but that top-1 reading
switched off (the [tokens, vocabulary] logits then built on first read every step, as before).

A tiny Qwen3 (2 layers, hidden 64) with a 151936-entry vocabulary (Qwen's), untied, fp32 on the CPU, rows of about
`--seq` tokens (a 16-word prompt and a long answer, the shipped word-level tokenizer: ms-swift keeps the logits of the
answer positions only), batch `--batch`, `--steps` steps. Each run is its own process tree;
peak memory is the resident high-water mark of the `swift sft` processes (RUSAGE_CHILDREN of a launcher that runs
only that command), so it includes the interpreter and imports. Losses and token accuracies per step from its
logging.jsonl.

    python benchmarks/bench_swift_memory.py --python /tmp/fw/swift/bin/python \
        [--out benchmarks/results/swift_memory_cpu.md]

The --python environment must have ms-swift (.ci/frameworks.sh FW_SWIFT=1 builds one) and this checkout installed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from results_io import emit  # noqa: E402

VARIANTS = ("plain ms-swift", "ms-swift + mindspeed_hf", "ms-swift + mindspeed_hf, top-1 reading off")
NO_TOP1 = '''import mindspeed_hf  # noqa: F401
from mindspeed_hf.patches import lazy_logits

lazy_logits._is_vocab_argmax = lambda *args, **kwargs: False  # the logits built on first read, as before
'''
LAUNCH = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
          "print('MAXRSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")


def _assets(tmp: Path, args) -> tuple[Path, Path]:
    """A Qwen3 with Qwen's vocabulary size and the shipped tokenizer, and chat rows of about args.seq tokens."""
    script = f"""
import json, sys, torch
sys.path.insert(0, {str(ROOT / 'examples' / 'frameworks')!r})
import make_tiny
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
out = Path({str(tmp)!r})
make_tiny.make_model(out)  # the tokenizer and config layout
sizes = {{"vocab_size": {args.vocab}, "max_position_embeddings": {args.seq}}}
config = AutoConfig.for_model(**{{**make_tiny.CONFIG, **sizes}})
torch.manual_seed(0)
AutoModelForCausalLM.from_config(config).float().save_pretrained(out / "model")
tokenizer = AutoTokenizer.from_pretrained(out / "model")
tokenizer.model_max_length = {args.seq}
tokenizer.save_pretrained(out / "model")
print(sorted(w for w in tokenizer.get_vocab() if w.isalpha()))
"""
    done = subprocess.run([args.python, "-c", script], capture_output=True, text=True, check=True)
    words = json.loads(done.stdout.strip().splitlines()[-1].replace("'", '"'))
    rng = random.Random(1)
    data = tmp / "rows.jsonl"
    with open(data, "w") as f:  # a short prompt and a long answer: ms-swift keeps logits for the answer only
        for _ in range(args.batch * args.steps):
            user, answer = (" ".join(rng.choice(words) for _ in range(n)) for n in (16, args.seq - 32))
            f.write(json.dumps({"messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return tmp / "model", data


def _run(variant: str, model: Path, data: Path, tmp: Path, args) -> dict:
    out = tmp / variant.replace(" ", "_").replace(",", "").replace("+", "")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINDSPEED_HF_") and k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="", HF_DATASETS_CACHE=str(tmp / "cache"))
    if variant == VARIANTS[0]:
        env["MINDSPEED_HF_AUTO"] = "0"
    else:
        hook = tmp / "hook_off" if variant == VARIANTS[2] else ROOT / "examples" / "frameworks" / "hook"
        if variant == VARIANTS[2]:
            hook.mkdir(exist_ok=True)
            (hook / "sitecustomize.py").write_text(NO_TOP1)
        env["PYTHONPATH"] = str(hook)
    swift = str(Path(args.python).with_name("swift"))
    cmd = [swift, "sft", "--model", str(model), "--model_type", "qwen3", "--template", "qwen3_nothinking",
           "--use_hf", "true", "--dataset", str(data), "--split_dataset_ratio", "0", "--tuner_type", "full",
           "--torch_dtype", "float32", "--max_length", str(args.seq), "--max_steps", str(args.steps),
           "--per_device_train_batch_size", str(args.batch), "--learning_rate", "1e-4", "--lr_scheduler_type",
           "constant", "--warmup_ratio", "0", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
           "--seed", "0", "--data_seed", "0", "--dataset_num_proc", "1", "--dataloader_num_workers", "0",
           "--gradient_checkpointing", "false", "--output_dir", str(out), "--add_version", "false"]
    done = subprocess.run([args.python, "-c", LAUNCH, *cmd], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-4000:]}")
    peak = int(next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("MAXRSS"))) * 1024
    records = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "loss" in r and "train_loss" not in r]
    return {"peak": peak, "loss": [r["loss"] for r in steps], "token_acc": [r.get("token_acc") for r in steps]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="the python of an environment with ms-swift installed")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--seq", type=int, default=768)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, data = _assets(tmp, args)
        runs = {variant: _run(variant, model, data, tmp, args) for variant in VARIANTS}
    version = subprocess.run([args.python, "-c", "import swift; print(swift.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    base = runs[VARIANTS[0]]
    lines = [f"# ms-swift {version} `swift sft`: peak memory with and without the fused loss's top-1 reading (CPU, "
             "fp32)", "", f"Tiny Qwen3 (2 layers, hidden 64), vocabulary {args.vocab} (untied), rows of about "
             f"{args.seq} tokens (a 16-token prompt), batch {args.batch}, {args.steps} steps, one thread; peak = "
             "resident high-water mark of the swift process tree (interpreter and imports included).", "",
             "| run | peak memory (MB) | / plain | losses | token_acc |", "|---|---|---|---|---|"]
    for variant in VARIANTS:
        r = runs[variant]
        losses = " ".join(f"{x:.6f}" for x in r["loss"])
        accs = " ".join(f"{x:.6f}" for x in r["token_acc"] if x is not None)
        lines.append(f"| {variant} | {r['peak'] / 2**20:.0f} | {r['peak'] / base['peak']:.2f}x | {losses} | {accs} |")
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
