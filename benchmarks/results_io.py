"""What the benchmark scripts share: print a result and write it where --out says."""

from __future__ import annotations

from pathlib import Path


def emit(text: str, out: str | None) -> None:
    """Print `text` (markdown) and, with `out`, write it there (creating the folder)."""
    print(text, flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)


def add_run_arguments(parser) -> None:
    """--dtype, --device, --out and the hidden --worker flag of the scripts that time plain HF against mindspeed_hf
    in child processes of themselves."""
    import argparse

    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--device", default=None, help="cpu, cuda or npu (default: what is here)")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def spread(values: list[float], digits: int = 2) -> str:
    """`median x [min-max]` of ratios measured over several process pairs (or rounds)."""
    import statistics

    return f"{statistics.median(values):.{digits}f}x [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def paired_rows(runs: list[dict[str, dict]], names: tuple[str, str] = ("plain HF", "mindspeed_hf")) -> list[str]:
    """Markdown rows for process pairs `runs` (each {name: {"step", "peak_bytes", "losses"}}): per name the median
    step time and peak over the pairs and the first pair's losses, then the ratio line (second name over first)."""
    import statistics

    base, ours = names
    lines = ["| run | step time (s, median of pairs) | peak memory (MB, median of pairs) | losses (first pair) |",
             "|---|---|---|---|"]
    for name in names:
        step = statistics.median(r[name]["step"] for r in runs)
        peak = statistics.median(r[name]["peak_bytes"] for r in runs) / 2**20
        lines.append(f"| {name} | {step:.4f} | {peak:.0f} | {' '.join(f'{x:.6f}' for x in runs[0][name]['losses'])} |")
    diff = max(abs(a - b) for r in runs for a, b in zip(r[base]["losses"], r[ours]["losses"], strict=True))
    time_ratio = [r[ours]["step"] / r[base]["step"] for r in runs]
    mem_ratio = [r[ours]["peak_bytes"] / r[base]["peak_bytes"] for r in runs]
    return lines + ["", f"step time ratio {spread(time_ratio)}, peak memory ratio {spread(mem_ratio)}, "
                        f"max |loss diff| {diff:.2e}"]


def run_worker_self(script: str, auto: str, *extra: str, **env: str) -> dict:
    """Run `script --worker ARGS` (this process's arguments plus `extra`) with MINDSPEED_HF_AUTO=`auto` and `env`;
    the JSON object on the last line of its output."""
    import json
    import os
    import subprocess
    import sys

    cmd = [sys.executable, script, "--worker", *extra, *sys.argv[1:]]
    out = subprocess.run(cmd, env={**os.environ, "MINDSPEED_HF_AUTO": auto, **env}, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def alternating_pairs(script: str, repeats: int, *extra: str, **env: str) -> list[dict[str, dict]]:
    """`repeats` process pairs of `script --worker`, plain HF (MINDSPEED_HF_AUTO=0) and mindspeed_hf (=1), the order
    alternating from pair to pair; one thread each. For paired_rows()."""
    order = (("plain HF", "0"), ("mindspeed_hf", "1"))
    return [{name: run_worker_self(script, auto, *extra, OMP_NUM_THREADS="1", **env)
             for name, auto in (order if repeat % 2 == 0 else order[::-1])} for repeat in range(repeats)]


def timed_steps(model, batch: dict, steps: int) -> dict:
    """`steps` training steps (forward, backward, AdamW) of `model` on `batch` on the CPU: the per-step losses, the
    median step time after the first and the process's peak resident memory."""
    import statistics
    import time

    import torch

    from mindspeed_hf.device import peak_memory_bytes, reset_peak_memory

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    reset_peak_memory("cpu")
    losses, times = [], []
    for _ in range(steps):
        began = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - began)
        losses.append(loss.item())
    return {"losses": losses, "step": statistics.median(times[1:]), "peak_bytes": peak_memory_bytes("cpu")}


def run_torchrun_self(script: str, model, args, names: tuple[str, ...], nproc: int = 2) -> dict:
    """Save `model` to a temporary directory and run `script --worker --model_dir=... --result=...` (plus the
    `names` of `args` as `--name=value`) under torchrun with `nproc` CPU processes (one thread each); the JSON
    object its rank 0 wrote to the result file."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        result = os.path.join(tmp, "result.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
        passed = [f"--{name}={getattr(args, name)}" for name in names]
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                        script, "--worker", f"--model_dir={tmp}", f"--result={result}", *passed], env=env, check=True)
        return json.loads(Path(result).read_text())


def torchrun_parser(description: str, **defaults: int):
    """The arguments of a benchmark that launches itself under torchrun (run_torchrun_self): the model and batch
    shape and the rounds (`defaults` overrides hidden, layers, batch, seq, steps, rounds), --out, and the worker's
    own --worker / --model_dir / --result."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    for name, default in {"hidden": 128, "layers": 4, "batch": 4, "seq": 128, "steps": 3, "rounds": 4,
                          **defaults}.items():
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--model_dir")
    ap.add_argument("--result")
    return ap


def torchrun_main(script: str, ap, worker, model_config, table) -> None:
    """main() of a benchmark that launches itself under torchrun: with --worker, `worker(args)` (one rank); else a
    model from `model_config(args)` (seed 0), the workers on it (run_torchrun_self, passing every setting of `ap`),
    and `table(result, args)` printed or written to --out."""
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(args))
    names = tuple(k for k in vars(args) if k not in ("out", "worker", "model_dir", "result"))
    emit(table(run_torchrun_self(script, model, args, names), args), args.out)


def interleaved_times(kinds: list[str], rounds: int, steps: int, step) -> dict[str, list[float]]:
    """Seconds per step of each kind over `rounds` rounds, the order alternating (a b, b a, ...), every rank
    starting and stopping together (barriers); `step(kind)` runs one step."""
    import time

    import torch.distributed as dist

    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for r in range(rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step(kind)
            dist.barrier()
            times[kind].append((time.perf_counter() - start) / steps)
    return times


def write_result(path: str, result: dict) -> None:
    """Rank 0 writes the worker's result (JSON) for run_torchrun_self; every rank waits for it."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps(result))
    dist.barrier()
