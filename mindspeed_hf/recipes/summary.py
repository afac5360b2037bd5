"""The summary `mindspeed-hf train` prints at the end of a run: which kernels ran (from `mindspeed_hf.report`),
before/after quality, steps, throughput, memory and where the checkpoint is. Printed by rank 0 only."""

from __future__ import annotations

import os
from typing import Any


def is_rank_zero() -> bool:
    """True in a single process and on global rank 0 under torchrun (RANK, else torch.distributed's rank)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def _listed(kernels: dict[str, int]) -> str:
    return ", ".join(f"{op} x{n:,}" for op, n in kernels.items() if n)


def applied(report: dict[str, Any]) -> str:
    """What report(model) says ran, as one phrase: report()["ran"] (op -> executions of our kernels) when the
    report has it, else the patched sites per op (report()["kernels"]); then what it says was kept (`kept`: an op
    left to another implementation, and why), the ops HF's own code runs being faster there (`hf_path`) and a vision
    tower's and an audio tower's own kernels."""
    ran = report.get("ran")
    text = f"kernel calls {_listed(ran)}" if ran and _listed(ran) else _listed(report["kernels"])
    kept = "; ".join(f"{op}: {why}" for op, why in (report.get("kept") or {}).items())
    vision = _listed(report.get("vision_kernels") or {})
    audio = _listed(report.get("audio_kernels") or {})
    parts = [text or ("no text kernel" if vision or audio else "")]
    parts += [f"vision tower: {vision}"] if vision else []
    parts += [f"audio tower: {audio}"] if audio else []
    parts += [f"kept: {kept}"] if kept else []
    hf_path = ", ".join(report.get("hf_path") or {})
    parts += [f"HF's code where ours gains nothing on this backend: {hf_path}"] if hf_path else []
    fell_back = _listed(report.get("fallbacks") or {})
    parts += [f"fell back to the torch path: {fell_back}"] if fell_back else []
    return "; ".join(p for p in parts if p) or "nothing"


def accelerator_state(result: dict[str, Any]) -> str:
    """"off", "on: <what ran>", or "on, but no kernel applies to this model"."""
    if not result["accelerated"]:
        return "off"
    return "on: " + result["applied"] if result["applied"] != "nothing" else "on, but no kernel applies to this model"


def _quality_lines(result: dict[str, Any]) -> list[str]:
    """The before/after table; "skipped" where the exact match was not measured (context parallelism)."""
    lines = [f"{'':16}{'held-out loss':>14}{'exact match':>18}"]
    for name in [n for n in ("before", "after") if result.get(n)]:
        q = result[name]
        n = q["num_prompts"]
        match = ("skipped" if q["exact_match"] is None
                 else f"{round(q['exact_match'] * n)}/{n} ({100 * q['exact_match']:.1f}%)")
        lines.append(f"{name + ' training':16}{q['eval_loss']:>14.4f}{match:>18}")
    return lines


def _steps_line(result: dict[str, Any]) -> str:
    """Steps this run ran (and the global step when it continued a checkpoint), time, tokens/s, peak memory."""
    ran, total = result.get("steps_run", result["steps"]), result["steps"]
    steps = f"steps {ran}" + (f" (global step {total}, resumed at {total - ran})" if ran != total else "")
    line = f"{steps} in {result['train_runtime_s']:.1f} s"
    tps = result["tokens_per_s"]
    if tps:
        line += f" | tokens/s {tps:,.0f} | peak memory {result['peak_memory_bytes'] / 2**20:,.0f} MiB"
    return line


def print_summary(result: dict[str, Any]) -> None:
    """The run's summary (rank 0 only): what ran, before/after quality, steps, throughput, memory, checkpoint."""
    if not is_rank_zero():
        return
    lines = [f"\nmindspeed-hf train: {result['model_type']} ({result['params'] / 1e6:.2f}M params) on "
             f"{result['device']}, accelerator {accelerator_state(result)}"]
    if result.get("after"):
        lines += _quality_lines(result)
    lines.append(_steps_line(result))
    loader = result.get("loader", "AutoModelForCausalLM")
    lines.append(f"checkpoint: {result['output_dir']} ({loader}.from_pretrained loads it)")
    print("\n".join(lines), flush=True)
