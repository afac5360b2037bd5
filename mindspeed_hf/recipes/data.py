"""Data for `mindspeed-hf train`: JSONL prompt/completion examples -> token ids with the loss on the completion
only, optional packing, and the padding collator."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from .run_config import DataSpec

IGNORE_INDEX = -100


def _parse_row(line: str, path: str | Path, number: int) -> dict[str, Any]:
    """One JSONL row; errors name the file and its real line (JSON's own message counts from the row)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno}); each line must be one "
                         "JSON object with the prompt and completion fields") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{number}: a JSON {type(row).__name__}, not an object; each line must be one JSON "
                         "object with the prompt and completion fields")
    return row


def read_jsonl(path: str | Path, spec: DataSpec) -> list[dict[str, str]]:
    """Rows of a JSONL file; each must hold the prompt and completion fields the spec names."""
    rows = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (byte {err.start}); data files are JSONL, one JSON object a "
                         "line") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        row = _parse_row(line, path, number)
        missing = [k for k in (spec.prompt_field, spec.completion_field) if k not in row]
        if missing:
            raise ValueError(f"{path}:{number}: missing field(s) {', '.join(missing)} (set data.prompt_field / "
                             f"data.completion_field); the row has {', '.join(row)}")
        rows.append({"prompt": str(row[spec.prompt_field]), "completion": str(row[spec.completion_field])})
    if not rows:
        raise ValueError(f"{path}: no examples")
    return rows


def split_rows(spec: DataSpec, seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train rows, held-out rows): the eval file, else a seeded `eval_fraction` of the train file."""
    train = read_jsonl(spec.train, spec)
    if spec.eval is not None:
        return train, read_jsonl(spec.eval, spec)
    n_eval = int(len(train) * spec.eval_fraction)
    if n_eval == 0:
        return train, []
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    held = set(order[:n_eval])
    return [r for i, r in enumerate(train) if i not in held], [r for i, r in enumerate(train) if i in held]


def encode(row: dict[str, str], tokenizer: Any, max_length: int) -> dict[str, list[int]]:
    """prompt + completion + EOS, truncated to max_length; labels mask the prompt (SFT on answers only)."""
    prompt = tokenizer(row["prompt"], add_special_tokens=True)["input_ids"]
    answer = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        answer = answer + [tokenizer.eos_token_id]
    ids = (prompt + answer)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt) + answer)[:max_length]
    return {"input_ids": ids, "labels": labels}


def pack(examples: list[dict[str, list[int]]], max_length: int) -> list[dict[str, list[int]]]:
    """Greedy packing into rows of at most max_length tokens. position_ids restart at every example, which is how
    transformers' mask builders recognise packed sequences and keep examples from attending to each other."""
    if any("pixel_values" in ex for ex in examples):  # 3-D M-RoPE positions restart per image example: not here
        raise ValueError("data.packing: image examples (pixel_values) cannot be packed by this text packer; "
                         "set data.packing: false")
    rows: list[dict[str, list[int]]] = []
    current: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for ex in examples:
        if current["input_ids"] and len(current["input_ids"]) + len(ex["input_ids"]) > max_length:
            rows.append(current)
            current = {"input_ids": [], "labels": [], "position_ids": []}
        current["input_ids"] += ex["input_ids"]
        current["labels"] += ex["labels"]
        current["position_ids"] += list(range(len(ex["input_ids"])))
    if current["input_ids"]:
        rows.append(current)
    return rows


def tokenize_rows(rows: list[dict[str, str]], tokenizer: Any, spec: DataSpec, packing: bool | None = None):
    """Token ids for every row (packed into max_length rows when asked)."""
    examples = [encode(r, tokenizer, spec.max_length) for r in rows]
    return pack(examples, spec.max_length) if (spec.packing if packing is None else packing) else examples


class PaddingCollator:
    """Right-pads a batch to its longest row: pad id for inputs, -100 for labels; attention_mask for unpacked
    rows; packed rows carry position_ids instead (padding continues the positions, labels ignore it)."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        length = max(len(x["input_ids"]) for x in batch)
        packed = "position_ids" in batch[0]
        out = {
            "input_ids": torch.full((len(batch), length), self.pad_token_id, dtype=torch.long),
            "labels": torch.full((len(batch), length), IGNORE_INDEX, dtype=torch.long),
        }
        if packed:
            out["position_ids"] = torch.zeros((len(batch), length), dtype=torch.long)
        else:
            out["attention_mask"] = torch.zeros((len(batch), length), dtype=torch.long)
        for i, x in enumerate(batch):
            n = len(x["input_ids"])
            out["input_ids"][i, :n] = torch.tensor(x["input_ids"])
            out["labels"][i, :n] = torch.tensor(x["labels"])
            if packed:
                pos = x["position_ids"]
                tail = range(pos[-1] + 1, pos[-1] + 1 + length - n)  # padding extends the last example
                out["position_ids"][i] = torch.tensor(list(pos) + list(tail))
            else:
                out["attention_mask"][i, :n] = 1
        return out
