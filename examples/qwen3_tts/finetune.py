"""Qwen3-TTS fine-tuning with HF Trainer, accelerated by `import mindspeed_hf`, driven by one YAML file.

    python examples/qwen3_tts/finetune.py examples/qwen3_tts/qwen3_tts.yaml
    torchrun --nproc_per_node 8 examples/qwen3_tts/finetune.py examples/qwen3_tts/qwen3_tts.yaml   # FSDP2 (YAML)
    MINDSPEED_HF_AUTO=0 python examples/qwen3_tts/finetune.py ...                                  # plain HF

YAML sections (relative paths are relative to the YAML file):
    model:       name_or_path (a Qwen3-TTS checkpoint directory), dtype (float32 | bfloat16), attn_implementation
    lora:        optional {r, alpha, dropout, target_modules}: train LoRA adapters (PEFT) instead of all weights
    data:        train (the prepared JSONL, see data.py)
    training:    TrainingArguments keys (bf16, FSDP2 via fsdp / fsdp_config, batch sizes, lr, ...)
    accelerator: optional mindspeed_hf settings (the keys of examples/configs/accelerator.yaml)
    losses_file: optional; per-step losses and the report as JSON lines (else stdout)
The objective and its label alignment are in tts_loss.py.
"""

import mindspeed_hf  # noqa: F401  (the one accelerator line; MINDSPEED_HF_AUTO=0 imports it without patching)

# isort: split
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from data import Collator, read_jsonl
from qwen_tts_loader import load_model
from transformers import Trainer, TrainingArguments
from tts_loss import Qwen3TTSFinetune

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/common.py
from common import JsonLines, LossLogger, emit_report  # noqa: E402

from mindspeed_hf.config import config_from_dict  # noqa: E402

SECTIONS = {"model", "lora", "data", "training", "accelerator", "losses_file"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def read_run(path: str) -> dict[str, Any]:
    """The YAML, checked: known sections, a model and a train file; relative paths resolved against the file."""
    file = Path(path)
    if not file.is_file():
        raise SystemExit(f"finetune.py: config file {path!r} does not exist")
    run = yaml.safe_load(file.read_text()) or {}
    unknown = set(run) - SECTIONS
    if unknown:
        raise SystemExit(f"{path}: unknown sections {sorted(unknown)}; valid: {sorted(SECTIONS)}")
    for section, key in (("model", "name_or_path"), ("data", "train")):
        if not (run.get(section) or {}).get(key):
            raise SystemExit(f"{path}: {section}.{key} is required")
    dtype = run["model"].get("dtype", "float32")
    if dtype not in DTYPES:
        raise SystemExit(f"{path}: model.dtype {dtype!r} is not valid; choose one of {', '.join(DTYPES)}")

    def resolve(value: str) -> str:
        return str((file.parent / value).resolve()) if not Path(value).is_absolute() else value

    run["model"]["name_or_path"] = resolve(run["model"]["name_or_path"])
    run["data"]["train"] = resolve(run["data"]["train"])
    if run.get("losses_file"):
        run["losses_file"] = resolve(run["losses_file"])
    return run


def with_lora(model: torch.nn.Module, lora: dict[str, Any]) -> torch.nn.Module:
    """LoRA adapters on the talker's and code predictor's projections; everything else frozen."""
    from peft import LoraConfig, get_peft_model

    unknown = set(lora) - {"r", "alpha", "dropout", "target_modules"}
    if unknown:
        raise SystemExit(f"lora: unknown keys {sorted(unknown)}; valid: r, alpha, dropout, target_modules")
    config = LoraConfig(r=lora.get("r", 16), lora_alpha=lora.get("alpha", 32), lora_dropout=lora.get("dropout", 0.0),
                        target_modules=lora.get("target_modules", LORA_TARGETS))
    return get_peft_model(model, config).get_base_model()  # adapters injected in place


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: finetune.py RUN.yaml")
    run = read_run(sys.argv[1])
    if run.get("accelerator") and mindspeed_hf.is_enabled():
        mindspeed_hf.enable(config_from_dict(run["accelerator"]))
    args = TrainingArguments(**{"remove_unused_columns": False, "report_to": "none", **run.get("training", {})})
    model_cfg = run["model"]
    model = load_model(model_cfg["name_or_path"], DTYPES[model_cfg.get("dtype", "float32")],
                       model_cfg.get("attn_implementation"))
    if run.get("lora"):
        model = with_lora(model, run["lora"])
    out = JsonLines(run.get("losses_file"))
    trainer = Trainer(model=Qwen3TTSFinetune(model), args=args, train_dataset=read_jsonl(run["data"]["train"]),
                      data_collator=Collator(model.config), callbacks=[LossLogger(out)])
    trainer.train()
    emit_report(out, trainer.model)


if __name__ == "__main__":
    main()
