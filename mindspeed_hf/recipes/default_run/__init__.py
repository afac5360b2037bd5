"""The embedded default run of `mindspeed-hf train`: a tiny Qwen3 config (run.yaml), a word-level tokenizer and
a synthetic instruction dataset, shipped with the package (regenerate with make_data.py)."""

from pathlib import Path

DEFAULT_RUN_DIR = Path(__file__).resolve().parent
DEFAULT_RUN_CONFIG = DEFAULT_RUN_DIR / "run.yaml"
TOKENIZER_DIR = DEFAULT_RUN_DIR / "tokenizer"
TRAIN_FILE = DEFAULT_RUN_DIR / "train.jsonl"
EVAL_FILE = DEFAULT_RUN_DIR / "eval.jsonl"

__all__ = ["DEFAULT_RUN_CONFIG", "DEFAULT_RUN_DIR", "EVAL_FILE", "TOKENIZER_DIR", "TRAIN_FILE"]
