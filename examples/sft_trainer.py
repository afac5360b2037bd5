"""Supervised fine-tuning with a plain transformers.Trainer: the one mindspeed_hf line is the import.

    python examples/sft_trainer.py --max_steps 10                      # accelerated
    MINDSPEED_HF_AUTO=0 python examples/sft_trainer.py --max_steps 10  # the same script, plain HF
    MINDSPEED_HF_CONFIG=examples/configs/accelerator.yaml python examples/sft_trainer.py

Prints {"step", "loss"} JSON lines (or writes them to --losses_file) and {"report": ...}: what was applied.
"""

import mindspeed_hf  # noqa: F401  (the one added line; MINDSPEED_HF_AUTO=0 imports it without patching)

# isort: split
from common import (
    QUICK_DEFAULTS,
    ExampleArguments,
    JsonLines,
    LossLogger,
    collate,
    emit_report,
    load_tokenizer,
    read_rows,
    tiny_model,
    tokenized,
)
from transformers import HfArgumentParser, Trainer, TrainingArguments


def main() -> None:
    parser = HfArgumentParser((ExampleArguments, TrainingArguments))
    parser.set_defaults(**QUICK_DEFAULTS)
    example, args = parser.parse_args_into_dataclasses()
    tokenizer = load_tokenizer()
    model = tiny_model(tokenizer, seed=args.seed)
    out = JsonLines(example.losses_file)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=tokenized(read_rows(example.num_examples), tokenizer, example.seq_length),
        data_collator=collate(tokenizer.pad_token_id),
        callbacks=[LossLogger(out)],
    )
    trainer.train()
    emit_report(out, trainer.model)


if __name__ == "__main__":
    main()
