"""LoRA fine-tuning (PEFT) with a plain transformers.Trainer: the kernels reach the base model under the LoRA
wrapper, and the adapters still train (the fused MLP calls the wrapped projections, never their raw weights).

    python examples/sft_lora.py --max_steps 10
    MINDSPEED_HF_AUTO=0 python examples/sft_lora.py --max_steps 10     # plain HF + PEFT

Prints {"step", "loss"} JSON lines (or writes them to --losses_file) and {"report": ...}.
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
from peft import LoraConfig, get_peft_model
from transformers import HfArgumentParser, Trainer, TrainingArguments


def main() -> None:
    parser = HfArgumentParser((ExampleArguments, TrainingArguments))
    parser.set_defaults(**QUICK_DEFAULTS)
    example, args = parser.parse_args_into_dataclasses()
    tokenizer = load_tokenizer()
    model = tiny_model(tokenizer, seed=args.seed)
    # LoRA on every linear layer of the decoder (lm_head stays frozen); the adapters start from the same seed.
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
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
