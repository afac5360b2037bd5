"""Worker for tests/distributed/test_tensor_parallel.py's Trainer runs: a plain transformers Trainer script, unchanged,
with tensor parallelism from MINDSPEED_HF_CONFIG (torchrun, gloo, CPU, fp32), and its single-process reference.

  reference (one process, plain HF, no mindspeed_hf): Trainer on the global batch (GLOBAL rows per step).
  tp        (torchrun; sizes from MINDSPEED_HF_CONFIG): the same script after `import mindspeed_hf`; each rank's
            micro-batch is GLOBAL / dp rows (every rank of a tp group gets the same batch).
--lora: a PEFT LoRA adapter on every projection (only the adapter trains); --save_steps / --resume: Trainer's
checkpoints (DCP shards under tp or FSDP2) and resuming from one, also onto another layout. Both end with
trainer.save_model(--out + ".saved"). Rank 0 writes the logged losses and grad norms, each parameter's
local share (tp run) and the final parameters (gathered) to --out (.json / .pt).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models
from tiny_models import tiny_model  # noqa: E402
from trainer_worker import collate, dataset  # noqa: E402 - uneven lengths, masked prompts, right padding

STEPS, GLOBAL = 3, 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["reference", "tp"])
    parser.add_argument("--family", choices=["llama", "qwen3", "qwen3_moe"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter on every projection (PEFT)")
    parser.add_argument("--momentum", action="store_true", help="SGD with momentum 0.9 (optimizer state to resume)")
    parser.add_argument("--save_steps", type=int, default=0, help="checkpoint every N steps (0: none)")
    parser.add_argument("--resume", default=None, help="resume_from_checkpoint")
    opts = parser.parse_args()
    if opts.scenario == "tp":
        import mindspeed_hf  # noqa: F401 - the drop-in: plain Trainer below is wired
    from torch.distributed.tensor import DTensor
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Record(TrainerCallback):
        losses: list[float] = []
        grad_norms: list[float] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))
                self.grad_norms.append(float(logs["grad_norm"]))

    args = TrainingArguments(output_dir=opts.out + ".dir", max_steps=STEPS, optim="sgd", learning_rate=0.5,
                             per_device_train_batch_size=GLOBAL // opts.dp, max_grad_norm=0.5, logging_steps=1,
                             report_to="none", disable_tqdm=True, seed=0,
                             save_strategy="steps" if opts.save_steps else "no", save_steps=opts.save_steps or 500,
                             dataloader_drop_last=True, use_cpu=True)
    record = Record()
    model = tiny_model(opts.family, use_cache=False)  # tie_word_embeddings=False (tiny_models' common config)
    if opts.lora:  # B initialised at random too (init_lora_weights=False), so the adapter acts from the first step
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj"]))
    # momentum: Trainer builds the optimizer from class and arguments (its state is what a resume must restore)
    momentum = {"optimizer_cls_and_kwargs": (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9})} if opts.momentum else {}
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), data_collator=collate, callbacks=[record],
                      **momentum)
    trainer.train(resume_from_checkpoint=opts.resume)
    shares = {n: [str(p.placements), p.to_local().numel() / p.numel()] for n, p in trainer.model.named_parameters()
              if isinstance(p, DTensor)}
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for n, p in trainer.model.named_parameters()}
    trainer.save_model(opts.out + ".saved")
    if trainer.args.process_index == 0:
        torch.save(params, opts.out + ".pt")
        dims = None
        if "mindspeed_hf.trainers" in sys.modules:  # the accelerated run: its mesh
            from mindspeed_hf.trainers import run_of

            dims = getattr(run_of(trainer), "dims", None)
        facts = {"attention": trainer.model.get_base_model().config._attn_implementation if opts.lora
                 else trainer.model.config._attn_implementation, "shares": shares,
                 "tp": dims.tp if dims else 1, "dp": dims.dp_size if dims else 1,
                 # decoder layers full recompute checkpoints (HF's flag), layer parts selective recompute wraps,
                 # layers activation offload wrapped
                 "memory": {"recompute": sum(type(m).__name__.endswith("DecoderLayer") and
                                             getattr(m, "gradient_checkpointing", False) is True
                                             for m in trainer.model.modules()),
                            "selective": sum("_mindspeed_recompute" in vars(m) for m in trainer.model.modules()),
                            "offload": sum(hasattr(m, "_mindspeed_offload") for m in trainer.model.modules())}}
        with open(opts.out, "w") as f:
            json.dump({"losses": record.losses, "grad_norms": record.grad_norms, **facts}, f)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
