"""Regenerate the embedded default run's data: a word-level tokenizer and a synthetic instruction dataset.

    python -m mindspeed_hf.recipes.default_run.make_data

The task is small enough for a ~600K-parameter model to learn in a few hundred steps on two CPU cores, and
structured enough that held-out exact-match accuracy shows it: five list operations (copy, reverse, sort,
first, last) on 3-6 letters. Train and eval prompts never overlap. Output is deterministic (fixed seed).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASKS = ("copy", "reverse", "sort", "first", "last")
LETTERS = tuple("abcdefghijklmnop")
SPECIALS = ("<pad>", "<unk>", "<bos>", "<eos>")
N_TRAIN, N_EVAL, SEED = 1600, 100, 0


def _answer(task: str, items: list[str]) -> list[str]:
    return {"copy": items, "reverse": items[::-1], "sort": sorted(items), "first": items[:1],
            "last": items[-1:]}[task]


def make_examples(n: int, seed: int = SEED) -> list[dict[str, str]]:
    """`n` distinct prompt/completion pairs such as {"prompt": "reverse : c a f =", "completion": " f a c"}."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict[str, str]] = []
    while len(rows) < n:
        task = rng.choice(TASKS)
        items = [rng.choice(LETTERS) for _ in range(rng.randint(3, 6))]
        prompt = f"{task} : {' '.join(items)} ="
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append({"prompt": prompt, "completion": " " + " ".join(_answer(task, items))})
    return rows


def make_tokenizer(directory: Path) -> None:
    """A whitespace word-level tokenizer (tokenizer.json + config) that AutoTokenizer loads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [*SPECIALS, ":", "=", *TASKS, *LETTERS]
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # WordPiece's decoder joins tokens with spaces (no "##" pieces exist here).
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        bos_token="<bos>", eos_token="<eos>", model_max_length=64)
    tokenizer.save_pretrained(str(directory))
    # transformers 5 records its own class name (TokenizersBackend); write the one every supported release loads.
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    rows = make_examples(N_TRAIN + N_EVAL)
    for name, part in (("train.jsonl", rows[:N_TRAIN]), ("eval.jsonl", rows[N_TRAIN:])):
        (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    make_tokenizer(HERE / "tokenizer")
    print(f"wrote {N_TRAIN} train / {N_EVAL} eval examples and the tokenizer to {HERE}")


if __name__ == "__main__":
    main()
