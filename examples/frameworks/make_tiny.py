"""Build what the framework examples and tests train: a tiny Qwen3 (random weights, built from a config) saved
with the tokenizer that ships in mindspeed_hf/recipes/default_run, and a small instruction dataset in the formats the
frameworks read (Alpaca JSON for LLaMA-Factory and axolotl, messages JSONL for ms-swift), registered in a
LLaMA-Factory dataset_info.json. Nothing is downloaded.

    python examples/frameworks/make_tiny.py OUT_DIR        # -> OUT_DIR/model, OUT_DIR/data
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

DEFAULT_RUN = Path(__file__).resolve().parents[2] / "mindspeed_hf" / "recipes" / "default_run"

CONFIG = dict(
    model_type="qwen3", vocab_size=27, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
    tie_word_embeddings=False, pad_token_id=0, bos_token_id=2, eos_token_id=3,
)


def make_model(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target = out / "model"
    if (target / "config.json").exists():
        return target
    torch.manual_seed(seed)
    config = AutoConfig.for_model(**CONFIG)
    model = AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(target)
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_RUN / "tokenizer")
    tokenizer.model_max_length = 128
    tokenizer.save_pretrained(target)
    return target


def make_data(out: Path, rows: int = 256) -> Path:
    """The default run's prompts/completions (`first : b i p =` -> ` b`) as Alpaca rows and as chat messages."""
    target = out / "data"
    target.mkdir(parents=True, exist_ok=True)
    source = [json.loads(line) for line in (DEFAULT_RUN / "train.jsonl").read_text().splitlines()[:rows]]
    alpaca = [{"instruction": r["prompt"], "input": "", "output": r["completion"].strip()} for r in source]
    (target / "tiny_alpaca.json").write_text(json.dumps(alpaca, indent=0))
    with open(target / "tiny_messages.jsonl", "w") as f:
        for r in source:
            f.write(json.dumps({"messages": [{"role": "user", "content": r["prompt"]},
                                             {"role": "assistant", "content": r["completion"].strip()}]}) + "\n")
    (target / "dataset_info.json").write_text(json.dumps({"tiny_alpaca": {"file_name": "tiny_alpaca.json"}},
                                                         indent=2))
    return target


def main(argv: list[str]) -> None:
    out = Path(argv[0] if argv else "tiny_fw")
    if len(argv) > 1 and argv[1] == "--fresh" and out.exists():
        shutil.rmtree(out)
    print(make_model(out), make_data(out))


if __name__ == "__main__":
    main(sys.argv[1:])
