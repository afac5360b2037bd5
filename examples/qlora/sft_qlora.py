"""QLoRA fine-tuning: a 4-bit NF4 base model (bitsandbytes, double quantisation), `prepare_model_for_kbit_training`
with gradient checkpointing, PEFT LoRA on every linear layer, and a plain transformers.Trainer. The kernels run
around the quantized projections (norms, rotary, attention, SwiGLU between the bitsandbytes Linear4bit + LoRA
layers) and the loss is the fused chunked one.

    python examples/qlora/sft_qlora.py --max_steps 10
    MINDSPEED_HF_AUTO=0 python examples/qlora/sft_qlora.py --max_steps 10            # plain HF + PEFT + bnb
    torchrun --nproc_per_node 2 examples/qlora/sft_qlora.py --max_steps 10 \\
        --per_device_train_batch_size 4 --fsdp full_shard --fsdp_config '{"fsdp_version": 2}'   # FSDP2

Without --model_name_or_path it quantizes the tiny model shipped with mindspeed_hf (saved once under
<output_dir>/base_model). Prints {"step", "loss"} JSON lines (or writes them to --losses_file) and {"report": ...}.
"""

import mindspeed_hf  # noqa: F401  (the one added line; MINDSPEED_HF_AUTO=0 imports it without patching)

# isort: split
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, HfArgumentParser, Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/common.py: the shipped model and data
from common import (  # noqa: E402
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


@dataclass
class QLoRAArguments:
    """The quantization and adapter settings of a usual QLoRA script."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "base model (default: the tiny one)"})
    compute_dtype: str = field(default="float32", metadata={"help": "bnb_4bit_compute_dtype: float32 or bfloat16"})
    quant_storage: str = field(default="uint8", metadata={"help": "bnb_4bit_quant_storage: uint8, bfloat16, float32"})
    double_quant: bool = field(default=True, metadata={"help": "bnb_4bit_use_double_quant"})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank"})


def base_model_path(qlora: QLoRAArguments, args: TrainingArguments, tokenizer) -> str:
    """The model to quantize: the one asked for, or the shipped tiny model, saved under the output directory by the
    first process while the others wait (under torchrun the process group exists once the arguments are parsed)."""
    if qlora.model_name_or_path:
        return qlora.model_name_or_path
    path = Path(args.output_dir) / "base_model"
    distributed = dist.is_available() and dist.is_initialized()
    if (not distributed or dist.get_rank() == 0) and not (path / "config.json").exists():
        tiny_model(tokenizer, seed=args.seed).save_pretrained(path)
    if distributed:
        dist.barrier()
    return str(path)


def device_map() -> dict | None:
    """Each torchrun process loads its 4-bit copy onto its own GPU (the usual `{"": local_rank}`); elsewhere
    transformers' default (the CPU; on Ascend, transformers puts 4-bit models on the current npu)."""
    if torch.cuda.is_available():
        return {"": int(os.environ.get("LOCAL_RANK", "0"))}
    return None


def main() -> None:
    parser = HfArgumentParser((ExampleArguments, QLoRAArguments, TrainingArguments))
    parser.set_defaults(**QUICK_DEFAULTS, gradient_checkpointing=True)
    example, qlora, args = parser.parse_args_into_dataclasses()
    tokenizer = load_tokenizer()
    compute_dtype = getattr(torch, qlora.compute_dtype)
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=qlora.double_quant,
        bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=getattr(torch, qlora.quant_storage),
    )
    model = AutoModelForCausalLM.from_pretrained(base_model_path(qlora, args, tokenizer), dtype=compute_dtype,
                                                 quantization_config=quantization, device_map=device_map())
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing)
    torch.manual_seed(args.seed)  # the adapters start from the same seed with and without the accelerator
    model = get_peft_model(model, LoraConfig(r=qlora.lora_r, lora_alpha=2 * qlora.lora_r, target_modules="all-linear",
                                             lora_dropout=0.0, task_type="CAUSAL_LM"))
    out = JsonLines(example.losses_file)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=tokenized(read_rows(example.num_examples), tokenizer, example.seq_length),
        data_collator=collate(tokenizer.pad_token_id),
        callbacks=[LossLogger(out)],
    )
    trainer.train()
    trainer.save_model()  # the adapter only (PEFT), consolidated under FSDP2
    emit_report(out, trainer.model)


if __name__ == "__main__":
    main()
