"""Worker for tests/distributed/test_deepspeed.py: HF Trainer with `deepspeed=<config>` under torchrun (2 ranks,
gloo, CPU), the user's script unmodified (the model comes from `AutoModelForCausalLM.from_config` after the
TrainingArguments, so ZeRO-3 builds it under `deepspeed.zero.Init`; no `use_cpu`, no `deepspeed.init_distributed`).

Launched with MINDSPEED_HF_AUTO=1 and the stages to run (zero2, zero3). In order, in one process, per stage:
  accelerated: 4 steps, checkpoints at steps 2 and 4; mindspeed_hf's kernels and fused loss (chunks of 8 rows)
  resumed:     a new model and Trainer resume the accelerated run from checkpoint-2 (steps 3 and 4)
  offload:     (ZeRO-2) the accelerated run with the optimizer offloaded to the CPU (torch AdamW: no JIT build)
  lora:        (ZeRO-3) PEFT LoRA on every linear layer of the partitioned model, with gradient checkpointing
  plain:       (after every stage's runs) mindspeed_hf.disable(), then the same training as HF runs it alone; the
               script then has to do
               what mindspeed_hf otherwise does for it (use_cpu=True, and for ZeRO-3 deepspeed.init_distributed,
               already done in this process by the accelerated runs)
Per-step losses are recorded on every rank (the loss each rank's training_step returned, unrounded) and gathered;
rank 0 writes the JSON report to --out. lm_head calls are recorded: HF's forward calls it once on [B, S, H]; the
fused loss calls a ZeRO-3 (partitioned) lm_head per chunk on [rows, H], and never calls a local (ZeRO-2) one.
"""

from __future__ import annotations

import argparse
import json
import os

import deepspeed.ops
import torch
import torch.distributed as dist
from trainer_worker import collate, dataset

# DeepSpeed's CPU comm JIT-compiles a shared-memory op (deepspeed_shm_comm: ~2 min of C++ on 2 cores, per
# environment) when it initialises; only its inference_all_reduce uses it, training never does. Marked unavailable,
# as on a machine without a compiler: the runs take gloo's collectives, the same ones with or without it.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

STEPS, BATCH, LR, CHUNK = 4, 2, 1e-2, 8
ZERO = {"stage": 2, "overlap_comm": False, "contiguous_gradients": True}
STAGES = {
    "zero2": ZERO,
    # threshold 0: partition every parameter (the default keeps small ones, the whole tiny model, unpartitioned)
    "zero3": {**ZERO, "stage": 3, "stage3_param_persistence_threshold": 0,
              "stage3_gather_16bit_weights_on_model_save": True},
}
OFFLOAD = {"offload_optimizer": {"device": "cpu", "pin_memory": False}}


def lora_under_zero3_trains() -> bool:
    """transformers 4.57 cannot train LoRA under ZeRO-3 even without mindspeed_hf: its lr scheduler keeps the
    parameter groups DeepSpeed dropped (plain run: "zip() argument 2 is longer than argument 1")."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version("5")


def ds_config(zero: dict, force_ds_cpu_optimizer: bool = True) -> dict:
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": False},
              "fp16": {"enabled": False}, "zero_optimization": zero}
    if not force_ds_cpu_optimizer:  # keep Trainer's torch AdamW under offload (DeepSpeedCPUAdam is a JIT build)
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def model_from_config():
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=131, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False))


def recording_trainer():
    from transformers import Trainer

    class Recording(Trainer):
        """Keeps the unrounded loss of every step (transformers 4.57 logs it rounded to 4 digits)."""

        losses: list[float]

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.losses.append(float(loss))
            return loss

    return Recording


def train(config: dict, out_dir: str, resume: str | None = None, lora: bool = False, **extra) -> dict:
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=out_dir, deepspeed=config, per_device_train_batch_size=BATCH,
                             max_steps=STEPS, learning_rate=LR, logging_steps=1, report_to="none", disable_tqdm=True,
                             seed=0, max_grad_norm=1.0, lr_scheduler_type="linear", dataloader_drop_last=True,
                             save_strategy="steps", save_steps=2, **extra)
    world_size = args.world_size  # what accelerate counted (HF filled train_batch_size from it)
    model = model_from_config()
    head_inputs: list[list[int]] = []
    model.lm_head.register_forward_pre_hook(lambda m, inputs: head_inputs.append(list(inputs[0].shape)))
    trained = model
    if lora:  # the adapters start from the same seed in both runs
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        trained = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    trainer = recording_trainer()(model=trained, args=args, train_dataset=dataset(STEPS * BATCH * 2),
                                  data_collator=collate)
    trainer.losses = []
    trainer.train(resume_from_checkpoint=resume)
    import mindspeed_hf

    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, trainer.losses)
    engine = trainer.model_wrapped
    return {"losses": losses, "world_size": world_size, "head_inputs": head_inputs,
            "lm_head_numel": model.lm_head.weight.numel(), "engine": type(engine).__name__,
            "zero_stage": engine.zero_optimization_stage(), "cpu_offload": bool(engine.zero_cpu_offload()),
            "optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
            "kernels": mindspeed_hf.report(model).get("kernels", {}) if mindspeed_hf.is_enabled() else {}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("stages", nargs="+", choices=sorted(STAGES))
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=-1)  # the `deepspeed` launcher passes it; the env has it too
    opts = ap.parse_args()
    import mindspeed_hf

    assert mindspeed_hf.is_enabled(), "launch with MINDSPEED_HF_AUTO=1"
    os.environ["MINDSPEED_HF_KERNELS_LOSS_CHUNK_SIZE"] = str(CHUNK)  # several chunks per rank and step
    mindspeed_hf.enable()  # re-read the process config with the chunk size
    result: dict[str, dict] = {}
    for stage in opts.stages:
        zero, root = STAGES[stage], os.path.join(opts.root, stage)
        result[stage] = {"accelerated": train(ds_config(zero), os.path.join(root, "accelerated"))}
        result[stage]["resumed"] = train(ds_config(zero), os.path.join(root, "resumed"),
                                         resume=os.path.join(root, "accelerated", "checkpoint-2"))
        if stage == "zero2":
            result[stage]["offload"] = train(ds_config({**zero, **OFFLOAD}, force_ds_cpu_optimizer=False),
                                             os.path.join(root, "offload"))
        if stage == "zero3" and lora_under_zero3_trains():
            result[stage]["lora"] = train(ds_config(zero), os.path.join(root, "lora"), lora=True,
                                          gradient_checkpointing=True)
    mindspeed_hf.disable()
    for stage in opts.stages:
        result[stage]["plain"] = train(ds_config(STAGES[stage]), os.path.join(opts.root, stage, "plain"),
                                       use_cpu=True)
        if stage == "zero3" and lora_under_zero3_trains():
            result[stage]["plain_lora"] = train(ds_config(STAGES[stage]), os.path.join(opts.root, stage, "plain_lora"),
                                                use_cpu=True, lora=True, gradient_checkpointing=True)
    if dist.get_rank() == 0:
        with open(opts.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()  # gloo's threads joined before exit (CI once aborted at exit without this)


if __name__ == "__main__":
    main()
