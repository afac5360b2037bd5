"""Shared by the example scripts: the embedded tiny model, its tokenizer and instruction data (shipped with
mindspeed_hf for `mindspeed-hf train`), and per-step loss output as JSON lines so runs can be compared.

Nothing here is needed by mindspeed_hf itself; a real script would load its own model and data.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM, TrainerCallback

from mindspeed_hf.recipes.default_run import TOKENIZER_DIR, TRAIN_FILE


@dataclass
class ExampleArguments:
    """Script options (HfArgumentParser turns them into flags next to the TrainingArguments ones)."""

    num_examples: int = field(default=256, metadata={"help": "training examples read from the shipped dataset"})
    seq_length: int = field(default=32, metadata={"help": "tokens per example (truncation length)"})
    losses_file: str | None = field(default=None, metadata={"help": "write JSON lines here instead of stdout"})


def load_tokenizer():
    """The shipped word-level tokenizer."""
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def tiny_model(tokenizer, seed: int = 0, tied: bool = True) -> Qwen3ForCausalLM:
    """A ~0.6M-parameter Qwen3-architecture model, initialised from `seed` (`tied`: lm_head shares the embeddings,
    as the shipped default does; tensor parallelism needs them apart)."""
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                         tie_word_embeddings=tied, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return Qwen3ForCausalLM(config)


def read_rows(n: int) -> list[dict[str, str]]:
    """The first `n` prompt/completion rows of the shipped dataset."""
    with open(TRAIN_FILE) as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def tokenized(rows: list[dict[str, str]], tokenizer, max_length: int) -> list[dict[str, list[int]]]:
    """prompt + completion + EOS; the loss only on the completion (prompt labels are -100)."""
    out = []
    for row in rows:
        prompt = tokenizer(row["prompt"])["input_ids"]
        answer = tokenizer(row["completion"])["input_ids"] + [tokenizer.eos_token_id]
        out.append({"input_ids": (prompt + answer)[:max_length],
                    "labels": ([-100] * len(prompt) + answer)[:max_length]})
    return out


def collate(pad_id: int):
    """Right-padding collator for `tokenized` rows."""

    def fn(batch):
        length = max(len(x["input_ids"]) for x in batch)
        ids = torch.full((len(batch), length), pad_id)
        labels = torch.full((len(batch), length), -100)
        mask = torch.zeros((len(batch), length), dtype=torch.long)
        for i, x in enumerate(batch):
            n = len(x["input_ids"])
            ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(x["input_ids"]), torch.tensor(x["labels"]), 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    return fn


class JsonLines:
    """Writes one JSON object per line to a file or stdout; under torchrun only rank 0 writes (the losses Trainer
    logs are already averaged over the ranks)."""

    def __init__(self, path: str | None) -> None:
        main_process = int(os.environ.get("RANK", "0")) == 0
        self.stream = (open(path, "w") if path else sys.stdout) if main_process else None

    def write(self, **record) -> None:
        if self.stream is None:
            return
        self.stream.write(json.dumps(record) + "\n")
        self.stream.flush()


class LossLogger(TrainerCallback):
    """Emits {"step": n, "loss": x} for every logged training step (set logging_steps=1 for every step)."""

    def __init__(self, out: JsonLines) -> None:
        self.out = out

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.out.write(step=state.global_step, loss=float(logs["loss"]))


def emit_report(out: JsonLines, model) -> None:
    """{"report": ...}: what mindspeed_hf applied to `model` (all zeros with MINDSPEED_HF_AUTO=0)."""
    import mindspeed_hf

    out.write(report=mindspeed_hf.report(model), enabled=mindspeed_hf.is_enabled())


def _asks_to_save(argv: list[str]) -> bool:
    """Whether the command line asks for checkpoints (`--save_steps N`) without naming a save strategy."""
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    return "--save_steps" in given and "--save_strategy" not in given


# Defaults that make the examples a few-second CPU run; every one can be overridden on the command line. No
# checkpoints unless the command line asks for them: `--save_steps N` alone saves every N steps (Trainer's own
# default strategy would ignore it under save_strategy "no").
QUICK_DEFAULTS = dict(output_dir="./example_output", max_steps=10, per_device_train_batch_size=8,
                      learning_rate=3e-3, logging_steps=1, save_strategy="steps" if _asks_to_save(sys.argv) else "no",
                      report_to="none", disable_tqdm=True, seed=0, bf16=False)
