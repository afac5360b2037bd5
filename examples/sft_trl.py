"""Supervised fine-tuning with TRL's SFTTrainer (prompt/completion data, loss on completions only).
SFTTrainer is a transformers.Trainer subclass, so `import mindspeed_hf` covers it too; TRL's own chunked LM
head sits on top of the accelerated model.

    python examples/sft_trl.py --max_steps 10
    MINDSPEED_HF_AUTO=0 python examples/sft_trl.py --max_steps 10      # plain TRL

Prints {"step", "loss"} JSON lines (or writes them to --losses_file) and {"report": ...}.
"""

import mindspeed_hf  # noqa: F401  (the one added line; MINDSPEED_HF_AUTO=0 imports it without patching)

# isort: split
from common import (
    QUICK_DEFAULTS,
    ExampleArguments,
    JsonLines,
    LossLogger,
    emit_report,
    load_tokenizer,
    read_rows,
    tiny_model,
)
from datasets import Dataset
from transformers import HfArgumentParser
from trl import SFTConfig, SFTTrainer


def main() -> None:
    parser = HfArgumentParser((ExampleArguments, SFTConfig))
    parser.set_defaults(**QUICK_DEFAULTS)
    example, args = parser.parse_args_into_dataclasses()
    args.max_length = example.seq_length
    tokenizer = load_tokenizer()
    model = tiny_model(tokenizer, seed=args.seed)
    out = JsonLines(example.losses_file)
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(read_rows(example.num_examples)),
        processing_class=tokenizer,
        callbacks=[LossLogger(out)],
    )
    trainer.train()
    emit_report(out, trainer.model)


if __name__ == "__main__":
    main()
