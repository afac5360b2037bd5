"""Vision-language fine-tuning with a plain transformers.Trainer: the one mindspeed_hf line is the import.

    python examples/vlm/sft_vlm.py --max_steps 10                          # accelerated
    MINDSPEED_HF_AUTO=0 python examples/vlm/sft_vlm.py --max_steps 10      # the same script, plain HF
    MINDSPEED_HF_CONFIG=examples/vlm/accelerator.yaml python examples/vlm/sft_vlm.py --freeze_vision true
    torchrun --nproc_per_node 2 examples/vlm/sft_vlm.py --max_steps 10 \\
        --fsdp full_shard --fsdp_config '{"fsdp_version": 2}'             # FSDP2
    python examples/vlm/sft_vlm.py --trainer trl --max_steps 10           # TRL's SFTTrainer instead of Trainer

The model is a tiny Qwen2.5-VL (or --model_type qwen3_vl) built from a config, the data the synthetic
shape-and-colour questions of `mindspeed-hf train --recipe vl` (mindspeed_hf/recipes/vl_data.py): images become Qwen-VL
patch rows without a processor, and the collator carries `mm_token_type_ids`, `pixel_values` and `image_grid_thw`.
A real script would load its model with AutoModelForImageTextToText.from_pretrained and its data with the model's
processor (which returns the same fields). Needs transformers >= 5.

Prints {"step", "loss"} JSON lines (or writes them to --losses_file) and {"report": ...}: what was applied.
"""

import mindspeed_hf  # noqa: F401  (the one added line; MINDSPEED_HF_AUTO=0 imports it without patching)

# isort: split
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText, HfArgumentParser, Trainer, TrainingArguments

from mindspeed_hf.recipes.vl import IMAGE_SIZE, VL_MODEL_TYPES, check_transformers, tiny_vl_config
from mindspeed_hf.recipes.vl_data import PatchLayout, VLCollator, encode_vl, make_examples, make_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/common.py: loss lines and the report
from common import QUICK_DEFAULTS, JsonLines, LossLogger, emit_report  # noqa: E402


@dataclass
class VLMArguments:
    """Script options (HfArgumentParser turns them into flags next to the TrainingArguments ones)."""

    model_type: str = field(default="qwen2_5_vl", metadata={"help": f"one of {', '.join(VL_MODEL_TYPES)}"})
    num_examples: int = field(default=256, metadata={"help": "synthetic training examples"})
    image_size: int = field(default=IMAGE_SIZE, metadata={"help": "image side in pixels (a multiple of 8)"})
    freeze_vision: bool = field(default=False, metadata={"help": "train the language model only (vision frozen)"})
    trainer: str = field(default="hf", metadata={"help": "hf (transformers.Trainer) or trl (TRL's SFTTrainer, with "
                                                            "its dataset preparation skipped: the collator does it)"})
    losses_file: str | None = field(default=None, metadata={"help": "write JSON lines here instead of stdout"})


def _arguments_class(trainer: str) -> type[TrainingArguments]:
    """The arguments dataclass of the chosen trainer: TrainingArguments, or TRL's SFTConfig (imported only then)."""
    if trainer == "hf":
        return TrainingArguments
    if trainer == "trl":
        from trl import SFTConfig

        return SFTConfig
    raise SystemExit(f"--trainer {trainer!r} is not valid; choose one of hf, trl")


def _sft_trainer(model, args: TrainingArguments, rows: list, collator: VLCollator, tokenizer, callbacks: list):
    """TRL's SFTTrainer the way its vision-language recipes use it: a collator that builds the model inputs, the
    dataset passed through untouched (dataset_kwargs skip_prepare_dataset, all columns kept)."""
    from datasets import Dataset
    from trl import SFTTrainer

    dataset = Dataset.from_list(rows).with_format("torch")
    return SFTTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                      processing_class=tokenizer, callbacks=callbacks)


def main() -> None:
    chosen = HfArgumentParser(VLMArguments).parse_args_into_dataclasses(return_remaining_strings=True)[0]
    parser = HfArgumentParser((VLMArguments, _arguments_class(chosen.trainer)))
    parser.set_defaults(**QUICK_DEFAULTS)
    if chosen.trainer == "trl":
        parser.set_defaults(dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False)
    example, args = parser.parse_args_into_dataclasses()
    check_transformers()
    tokenizer = make_tokenizer()
    torch.manual_seed(args.seed)
    config = tiny_vl_config(tokenizer, example.model_type)
    model = AutoModelForImageTextToText.from_config(config)
    if example.freeze_vision:
        model.model.visual.requires_grad_(False)
    layout = PatchLayout.of(config.vision_config)
    rows = [encode_vl(r, tokenizer, layout) for r in make_examples(example.num_examples, example.image_size, args.seed)]
    out = JsonLines(example.losses_file)
    collator = VLCollator(tokenizer.pad_token_id)
    if example.trainer == "trl":
        trainer = _sft_trainer(model, args, rows, collator, tokenizer, [LossLogger(out)])
    else:
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collator,
                          callbacks=[LossLogger(out)])
    trainer.train()
    emit_report(out, trainer.model)


if __name__ == "__main__":
    main()
