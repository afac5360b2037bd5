"""`mindspeed-hf train`: one SFT run from a YAML run description (or the embedded default).

It prints held-out loss and exact-match accuracy of greedy answers before and after training, logs loss,
tokens/s and peak memory while training, and writes an HF checkpoint (model + tokenizer) that
`AutoModelForCausalLM.from_pretrained` loads. With `--metrics-file` it also writes the numbers as JSON
(read by `mindspeed-hf bench`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from ..device import detect_device_type, peak_memory_bytes, reset_peak_memory
from ..value_kinds import parse_flag
from .data import PaddingCollator, split_rows, tokenize_rows
from .run_config import ModelSpec, RunConfig, build_training_args
from .summary import applied, is_rank_zero, print_summary

logger = logging.getLogger("mindspeed_hf")


class ThroughputCallback(TrainerCallback):
    """Adds tokens/s and peak memory to every log line, and keeps every logged loss by step."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.losses: dict[int, float] = {}
        self._mark = (time.perf_counter(), 0)
        self._after_first: tuple[float, int] | None = None
        self._end: tuple[float, int] | None = None
        self.start_step = 0  # the global step training began at (a resumed run: its checkpoint's)

    def on_train_begin(self, args, state, control, **kwargs):
        reset_peak_memory(self.device_type)
        self.start_step = state.global_step
        self._mark = (time.perf_counter(), state.num_input_tokens_seen)

    def on_step_end(self, args, state, control, **kwargs):
        now = (time.perf_counter(), state.num_input_tokens_seen)
        if self._after_first is None:  # the first step pays one-time costs: keep it out of tokens/s
            self._after_first = now
        self._end = now

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:
            return
        self.losses[state.global_step] = float(logs["loss"])
        now = (time.perf_counter(), state.num_input_tokens_seen)
        seconds, tokens = now[0] - self._mark[0], now[1] - self._mark[1]
        if seconds > 0 and tokens > 0:
            logs["tokens_per_s"] = round(tokens / seconds, 1)
        logs["peak_mem_mib"] = round(peak_memory_bytes(self.device_type) / 2**20, 1)
        self._mark = now

    def tokens_per_second(self) -> float | None:
        """Steady-state throughput: tokens after the first step over the time after it."""
        if self._after_first is None or self._end is None or self._end[0] <= self._after_first[0]:
            return None
        return (self._end[1] - self._after_first[1]) / (self._end[0] - self._after_first[0])


@contextlib.contextmanager
def _names_setting(setting: str, value: str) -> Iterator[None]:
    """A model / tokenizer that does not load (a hub id that does not exist, no network): the setting named."""
    try:
        yield
    except OSError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OSError(f"{setting}: {value!r} does not load: {first}") from err


def load_tokenizer(spec: ModelSpec) -> Any:
    """The run's tokenizer (local directory or hub id)."""
    from transformers import AutoTokenizer

    with _names_setting("model.tokenizer", spec.tokenizer):
        return AutoTokenizer.from_pretrained(spec.tokenizer)


def build_model(spec: ModelSpec, tokenizer: Any):
    """The causal LM the spec describes: from scratch (config) or pretrained (name_or_path)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, spec.dtype)
    kwargs = {"dtype": dtype}
    if spec.attn_implementation:
        kwargs["attn_implementation"] = spec.attn_implementation
    if spec.name_or_path is not None:
        with _names_setting("model.name_or_path", spec.name_or_path):
            return AutoModelForCausalLM.from_pretrained(spec.name_or_path, **kwargs)
    if isinstance(spec.config, str):
        config = AutoConfig.from_pretrained(spec.config)
    else:
        values = dict(spec.config)
        values.setdefault("vocab_size", len(tokenizer))
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            values.setdefault(name, getattr(tokenizer, name))
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    return AutoModelForCausalLM.from_config(config, **kwargs)


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[torch.device]:
    """`model` in eval mode for the block (its training mode restored after); yields the device it is on."""
    was_training = model.training
    model.eval()
    try:
        yield next(model.parameters()).device
    finally:
        model.train(was_training)


@torch.no_grad()
def exact_match(model: torch.nn.Module, tokenizer: Any, rows: list[dict[str, str]], max_new_tokens: int) -> float:
    """Share of prompts whose greedy answer equals the reference completion (whitespace-trimmed)."""
    if not rows:
        return float("nan")
    correct = 0
    with evaluating(model) as device:
        for row in rows:  # one at a time: no padding, so nothing about the answer depends on the batch
            ids = tokenizer(row["prompt"], return_tensors="pt")["input_ids"].to(device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
            answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            correct += answer.strip() == row["completion"].strip()
    return correct / len(rows)


def context_parallel_size(trainer: Any) -> int:
    """The trainer's context-parallel size (1 when its model is not split over a cp group)."""
    from ..runtime import run_of

    run = run_of(trainer)
    return run.plan.cp if run is not None and run.plan is not None else 1


def _quality(trainer: Any, tokenizer: Any, rows: list[dict[str, str]], run: RunConfig) -> dict[str, Any]:
    """Held-out loss (Trainer.evaluate) and the exact match of greedy answers. Under context parallelism the
    sequence is split over the cp group and `generate` cannot run: the loss only, the exact match skipped."""
    loss = trainer.evaluate()["eval_loss"] if trainer.eval_dataset is not None else float("nan")
    prompts = rows[: run.evaluation.num_prompts]
    cp = context_parallel_size(trainer)
    if cp > 1:
        if is_rank_zero() and not getattr(trainer, "_mindspeed_said_cp_quality", False):
            trainer._mindspeed_said_cp_quality = True
            logger.info("mindspeed-hf train: parallel.cp=%d: exact match skipped (greedy generation cannot run on a "
                        "sequence split over the cp group); the held-out loss is measured", cp)
        acc = None
    else:
        acc = exact_match(trainer.model, tokenizer, prompts, run.evaluation.max_new_tokens)
    return {"eval_loss": float(loss), "exact_match": acc, "num_prompts": len(prompts)}


def training_args_for(run: RunConfig, overrides: list[str] | None = None):
    """The run's TrainingArguments (MindSpeedTrainingArguments when the accelerator is on; MINDSPEED_HF_AUTO=0
    gives the plain-HF baseline). Built before the model, so bad values fail first."""
    import mindspeed_hf

    return build_training_args(run, overrides or [], mindspeed_hf.is_enabled())


def _resume_target(value: str | None) -> str | bool | None:
    """TrainingArguments.resume_from_checkpoint as Trainer.train takes it: "true" -> the newest checkpoint."""
    if value is None or not str(value).strip():
        return None
    try:
        return True if parse_flag(value, "--resume_from_checkpoint") else None
    except ValueError:  # not a true/false word: a path
        return str(value)


def check_parallel_sizes(run: RunConfig, args: Any) -> Any:
    """The run's mesh sizes against the world size (WORLD_SIZE under torchrun), before any model is built: the
    same check the trainer makes (which logs what it decides), so a wrong size is one line here instead of a
    traceback per rank later. Returns the FSDP plan (None: the model will not be sharded)."""
    import os

    import mindspeed_hf

    if not mindspeed_hf.is_enabled():
        return None
    from ..runtime import resolve_config, resolve_plan
    from ..trainers import deepspeed

    resolved = resolve_config(args)  # the trainer's own resolution (the run file's settings ride on `args`)
    deepspeed.check_exclusive(args, resolved)  # the trainer's first check too
    return resolve_plan(args, resolved, world_size=int(os.environ.get("WORLD_SIZE", "1")), announce=False)


def check_resume(args: Any) -> None:
    """Settle --resume_from_checkpoint before any work: without PATH, the newest complete checkpoint of output_dir
    whose files read whole (interrupted saves and unreadable checkpoints are skipped, saying so); with PATH, that
    checkpoint checked. Sets args.resume_from_checkpoint to the directory found; fails with one line otherwise.
    Without it, a new run with the accelerator on is refused before any model is built when output_dir holds another
    run's checkpoints (unless checkpoints.overwrite; a restarted attempt resumes by itself in the trainer:
    trainers/starting.py)."""
    import mindspeed_hf

    from .. import checkpoints
    from ..runtime import elastic
    from ..trainers import starting

    target = _resume_target(args.resume_from_checkpoint)
    if target is None:
        if elastic.restart() is None and mindspeed_hf.is_enabled():  # MINDSPEED_HF_AUTO=0: plain Hugging Face
            from ..runtime import resolve_config

            starting.guard_new_run(args.output_dir, resolve_config(args).config.checkpoints.overwrite, args)
        return
    try:
        if target is True:
            found = checkpoints.newest_resumable(str(args.output_dir))
        else:
            found = checkpoints.check_checkpoint(target, sharded=False)
    except checkpoints.CheckpointError as err:
        raise ValueError(f"--resume_from_checkpoint: {err}") from None
    args.resume_from_checkpoint = found


def run_training(run: RunConfig, args: Any = None, metrics_file: str | None = None,
                 quality_eval: bool | None = None, callbacks: list[Any] | None = None) -> dict[str, Any]:
    """Run one SFT job with `args` (default: training_args_for(run)); returns (and optionally writes) metrics.
    `callbacks`: extra TrainerCallbacks (`mindspeed-hf bench` counts a step with one)."""
    from transformers import Trainer, set_seed

    import mindspeed_hf

    started = time.perf_counter()
    accelerated = mindspeed_hf.is_enabled()
    if args is None:
        args = training_args_for(run)
    tokenizer = load_tokenizer(run.model)
    train_rows, eval_rows = split_rows(run.data, args.seed)
    train_ds = tokenize_rows(train_rows, tokenizer, run.data)
    eval_ds = tokenize_rows(eval_rows, tokenizer, run.data, packing=False) if eval_rows else None
    set_seed(args.seed)
    model = build_model(run.model, tokenizer)
    device_type = detect_device_type()
    if device_type == "cpu" and run.runtime.cpu_threads:
        torch.set_num_threads(run.runtime.cpu_threads)
    throughput = ThroughputCallback(device_type)
    trainer_cls = mindspeed_hf.MindSpeedTrainer if accelerated else Trainer
    trainer = trainer_cls(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                          data_collator=PaddingCollator(tokenizer.pad_token_id), processing_class=tokenizer,
                          callbacks=[throughput, *(callbacks or [])])
    do_quality = run.evaluation.enabled if quality_eval is None else quality_eval
    resume = _resume_target(args.resume_from_checkpoint)
    # "before" is the untrained model's quality: meaningless for a run that continues from a checkpoint (also the
    # one a restarted attempt resumes by itself)
    from ..runtime import elastic

    fresh = resume is None and elastic.restart() is None
    before = _quality(trainer, tokenizer, eval_rows, run) if do_quality and fresh else None
    output = trainer.train(resume_from_checkpoint=resume)
    after = _quality(trainer, tokenizer, eval_rows, run) if do_quality else None
    trainer.save_model(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    result = collect_result(trainer, output, throughput, started=started, before=before, after=after)
    print_summary(result)
    write_metrics(result, metrics_file)
    return result


def collect_result(trainer: Any, output: Any, throughput: ThroughputCallback, started: float,
                   before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
    """The run's metrics (what `--metrics-file` writes and `mindspeed-hf bench` reads) after `trainer.train()`
    returned `output`; `started`: perf_counter() at the start of the run."""
    import mindspeed_hf

    model = trainer.model
    report = mindspeed_hf.report(model)
    return {
        "accelerated": mindspeed_hf.is_enabled(),
        "device": throughput.device_type,
        "model_type": model.config.model_type,
        "params": sum(p.numel() for p in model.parameters()),
        "report": report,
        "applied": applied(report),
        "steps": output.global_step,  # the global step (a resumed run counts its checkpoint's steps too)
        "steps_run": output.global_step - throughput.start_step,
        "losses": {str(k): v for k, v in sorted(throughput.losses.items())},
        "train_loss": output.training_loss,
        "tokens_per_s": throughput.tokens_per_second(),
        "peak_memory_bytes": peak_memory_bytes(throughput.device_type),
        "train_runtime_s": output.metrics.get("train_runtime", 0.0),
        "total_runtime_s": time.perf_counter() - started,
        "before": before,
        "after": after,
        "output_dir": str(Path(trainer.args.output_dir)),
    }


def write_metrics(result: dict[str, Any], metrics_file: str | None) -> None:
    """Write the run's metrics as JSON to `metrics_file` (nothing when it is None; rank 0 under torchrun)."""
    if metrics_file and is_rank_zero():
        Path(metrics_file).parent.mkdir(parents=True, exist_ok=True)
        Path(metrics_file).write_text(json.dumps(result, indent=1, default=str))
