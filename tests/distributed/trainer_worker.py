"""Worker for tests/distributed/test_trainer_fsdp.py: Trainer runs with FSDP2 under torchrun (gloo, CPU), and the
single-process Trainer runs they must match. Rank 0 writes a JSON report to --out; parameters go to .pt files.

  reference (one process, plain HF, no mindspeed_hf): the same trainings on the same global batch.
  train  (2 ranks): MindSpeedTrainer dp_shard=2 (clipping, eval, checkpoints at steps 2 and 4, save_model, then a
                    simulated crash: checkpoint-4 without its COMPLETE marker and an unmarked checkpoint-3), again with
                    mindspeed_hf's kernels (fused loss on the sharded lm_head); plain Trainer with
                    fsdp="full_shard" + fsdp_config version 2 and gradient accumulation 2; PEFT LoRA.
  hsdp   (4 ranks): MindSpeedTrainer with dp_replicate=2 x dp_shard=2 and gradient accumulation 2.
  env    (2 ranks, run with the variables `accelerate launch` exports for an FSDP2 config): plain Trainer with FSDP
                    only from the environment (weights loaded on rank 0 only: cpu_ram_efficient_loading); resume of
                    the `train` run from its newest complete checkpoint; load_best_model_at_end.
Kernels stay off (HF's own model code) except in one run, so the sharding is tested alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

STEPS, BATCH, LR, SEQ, N = 4, 2, 1e-2, 16, 64  # BATCH per rank; the reference uses 2 * BATCH
KERNELS_OFF = {"rms_norm": False, "rope": False, "swiglu": False, "attention": False,
               "fused_linear_cross_entropy": False}
COMMON = dict(max_steps=STEPS, learning_rate=LR, logging_steps=1, report_to="none", disable_tqdm=True, seed=0,
              save_strategy="no", max_grad_norm=0.05, lr_scheduler_type="linear",
              dataloader_drop_last=True, per_device_eval_batch_size=1)
# FSDP2 through TrainingArguments on every supported transformers (4.57 reads fsdp=True alone as FSDP1 for accelerate)
FSDP2 = dict(fsdp=True, fsdp_config={"fsdp_version": 2})
# SGD makes the clipping visible in the parameters (AdamW is almost blind to a gradient scale).
GA2 = dict(gradient_accumulation_steps=2, optim="sgd", learning_rate=0.5, max_grad_norm=0.5)
# load_best_model_at_end with the "best" being the highest eval loss: an early checkpoint, not the final model.
BEST = dict(eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1, load_best_model_at_end=True,
            metric_for_best_model="eval_loss", greater_is_better=True)


def tiny_model(lora: bool = False):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=131, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                                 lora_dropout=0.0))
        with torch.no_grad():  # non-zero B so the adapter matters from step 0
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(std=0.05)
    return model


def dataset(n: int = N, seed: int = 1) -> list[dict[str, list[int]]]:
    """Uneven lengths, masked prompts: ranks hold different numbers of loss tokens."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = 6 + int(torch.randint(0, SEQ - 6, (1,), generator=g))
        ids = torch.randint(1, 128, (length,), generator=g).tolist()
        prompt = i % 5
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def collate(batch):
    length = max(len(x["input_ids"]) for x in batch)
    ids = torch.zeros(len(batch), length, dtype=torch.long)
    labels = torch.full((len(batch), length), -100)
    mask = torch.zeros(len(batch), length, dtype=torch.long)
    for i, x in enumerate(batch):
        n = len(x["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(x["input_ids"]), torch.tensor(x["labels"]), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def recorder():
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def __init__(self):
            self.losses, self.grad_norms = [], []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))
                self.grad_norms.append(float(logs["grad_norm"]))

    return Record()


def run(trainer_cls, model, args, eval_after: bool = False, **train_kwargs) -> tuple[object, dict]:
    rec = recorder()
    evals = dataset(8, seed=2) if args.eval_strategy != "no" else None
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset(), eval_dataset=evals, data_collator=collate,
                          callbacks=[rec])
    trainer.train(**train_kwargs)
    out = {"losses": rec.losses, "grad_norms": rec.grad_norms}
    if args.load_best_model_at_end:
        out["best"] = os.path.basename(trainer.state.best_model_checkpoint)
    if eval_after:
        out["eval_loss"] = trainer.evaluate(eval_dataset=dataset(8, seed=2))["eval_loss"]
    return trainer, out


def full_params(model) -> dict[str, torch.Tensor]:
    """Gathered parameters (collective under FSDP), keyed by name."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def save_params(model, path: str) -> None:
    params = full_params(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(params, path)


def sharding(trainer) -> dict:
    params = list(trainer.model.named_parameters())
    opt_params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    return {"all_dtensor": all(isinstance(p, DTensor) for _, p in params),
            "placements": sorted({str(p.placements) for _, p in params if isinstance(p, DTensor)}),
            "optimizer_on_dtensors": bool(opt_params) and all(isinstance(p, DTensor) for p in opt_params),
            "wrapped_is_model": trainer.model_wrapped is trainer.model,
            "frozen_sharded": all(isinstance(p, DTensor) for _, p in params if not p.requires_grad)}


def targs(cls, out_dir: str, **kw):
    return cls(output_dir=out_dir, **{**COMMON, **kw})


# ---------------------------------------------------------------------------------------------- scenarios
def scenario_reference(root: str) -> dict:
    from transformers import Trainer, TrainingArguments

    tiny_model().save_pretrained(os.path.join(root, "env_src"))  # what the `env` run loads
    out = {}
    for name, kw, lora, ranks in (("base", {}, False, 2), ("ga2", GA2, False, 2), ("lora", {}, True, 2),
                                  ("hsdp", GA2, False, 4), ("best", BEST, False, 2)):
        args = targs(TrainingArguments, os.path.join(root, f"ref_{name}"), per_device_train_batch_size=ranks * BATCH,
                     use_cpu=True, **kw)
        trainer, out[name] = run(Trainer, tiny_model(lora), args, eval_after=name == "base")
        save_params(trainer.model, os.path.join(root, f"ref_{name}.pt"))
    return out


def scenario_train(root: str) -> dict:
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import mindspeed_hf
    from mindspeed_hf.config import load_config
    from mindspeed_hf.trainers import MindSpeedTrainer, MindSpeedTrainingArguments

    rank, out = dist.get_rank(), {}
    # 1. MindSpeedTrainer, sizes from its arguments; checkpoints at 2 and 4; eval; consolidated save.
    ms_dir = os.path.join(root, "ms")
    off = {f"mindspeed_{k}": v for k, v in KERNELS_OFF.items()}
    args = targs(MindSpeedTrainingArguments, ms_dir, per_device_train_batch_size=BATCH, mindspeed_dp_shard=2,
                 save_strategy="steps", save_steps=2, **off)
    trainer, res = run(MindSpeedTrainer, tiny_model(), args, eval_after=True)
    res.update(sharding(trainer))  # after evaluate(): resharded again
    res["report_kernels"] = trainer.mindspeed_report["kernels"]
    save_params(trainer.model, os.path.join(root, "ms.pt"))
    hf_dir = os.path.join(root, "ms_export")
    trainer.save_model(hf_dir)
    if rank == 0:
        res["export_files"] = sorted(os.listdir(hf_dir))
        ckpt = os.path.join(ms_dir, "checkpoint-2")
        saved = torch.load(os.path.join(ckpt, "training_args.bin"), weights_only=False)
        res["use_cpu"] = {"given": False, "after_training": args.use_cpu, "saved": saved.use_cpu}
        res["ckpt_files"] = sorted(os.path.relpath(os.path.join(d, f), ckpt) for d, _, fs in os.walk(ckpt) for f in fs)
        loaded = AutoModelForCausalLM.from_pretrained(hf_dir)
        torch.save({n: p.detach() for n, p in loaded.named_parameters()}, os.path.join(root, "ms_export.pt"))
        # a crash before checkpoint-4 was marked complete, and an unmarked directory from another crash
        os.remove(os.path.join(ms_dir, "checkpoint-4", "COMPLETE"))
        os.makedirs(os.path.join(ms_dir, "checkpoint-3"))
        shutil.copy(os.path.join(ms_dir, "checkpoint-2", "trainer_state.json"), os.path.join(ms_dir, "checkpoint-3"))
    out["ms"] = res
    dist.barrier()

    # 1b. The same with mindspeed_hf's kernels on: the fused loss reads the FSDP-sharded (untied) lm_head.
    args = targs(MindSpeedTrainingArguments, os.path.join(root, "ms_kernels"), per_device_train_batch_size=BATCH,
                 mindspeed_dp_shard=2)
    trainer, res = run(MindSpeedTrainer, tiny_model(), args)
    res.update(sharding(trainer), report_kernels=trainer.mindspeed_report["kernels"])
    out["ms_kernels"] = res

    # 2. Plain Trainer after `import mindspeed_hf`: FSDP from fsdp/fsdp_config; gradient accumulation 2.
    mindspeed_hf.enable(load_config({"kernels": KERNELS_OFF}))
    args = targs(TrainingArguments, os.path.join(root, "plain"), per_device_train_batch_size=BATCH,
                 fsdp="full_shard", fsdp_config={"fsdp_version": 2}, **GA2)
    trainer, res = run(Trainer, tiny_model(), args)
    res.update(sharding(trainer), accelerate_fsdp=trainer.is_fsdp_enabled,
               num_processes=trainer.accelerator.num_processes)
    save_params(trainer.model, os.path.join(root, "plain.pt"))
    out["plain"] = res

    # 3. PEFT LoRA on the sharded base; adapter-only save.
    args = targs(TrainingArguments, os.path.join(root, "lora"), per_device_train_batch_size=BATCH, **FSDP2)
    trainer, res = run(Trainer, tiny_model(lora=True), args)
    res.update(sharding(trainer))
    save_params(trainer.model, os.path.join(root, "lora.pt"))
    lora_dir = os.path.join(root, "lora_export")
    trainer.save_model(lora_dir)
    if rank == 0:
        from peft import PeftModel

        res["export_files"] = sorted(os.listdir(lora_dir))
        reloaded = PeftModel.from_pretrained(tiny_model(), lora_dir)
        torch.save({n: p.detach() for n, p in reloaded.named_parameters() if "lora_" in n},
                   os.path.join(root, "lora_export.pt"))
    out["lora"] = res

    # 4. bf16 mixed precision: bf16 compute and gathers, fp32 sharded master weights and reductions.
    args = targs(TrainingArguments, os.path.join(root, "bf16"), per_device_train_batch_size=BATCH, **FSDP2,
                 bf16=True, use_cpu=True, max_steps=2)  # HF wants use_cpu for bf16 on a CPU
    seen: set[str] = set()
    model = tiny_model()
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.add(str(m.weight.dtype)))
    trainer, res = run(Trainer, model, args)
    res.update(sharding(trainer), param_dtypes=sorted({str(p.dtype) for p in trainer.model.parameters()}),
               compute_dtypes=sorted(seen))
    out["bf16"] = res
    return out


def scenario_env(root: str) -> dict:
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import mindspeed_hf
    from mindspeed_hf.config import load_config
    from mindspeed_hf.trainers import MindSpeedTrainer

    rank, out = dist.get_rank(), {}
    mindspeed_hf.enable(load_config({"kernels": KERNELS_OFF}))
    # 1. FSDP from the accelerate launch environment alone; rank 0 alone reads the weights.
    model = AutoModelForCausalLM.from_pretrained(os.path.join(root, "env_src"))
    if rank == 1:  # what a loader that reads on rank 0 only leaves behind; the sharding must broadcast rank 0's
        model = model.to("meta")
    out["meta_on_rank"] = [None] * dist.get_world_size()
    dist.all_gather_object(out["meta_on_rank"], any(p.is_meta for p in model.parameters()))
    args = targs(TrainingArguments, os.path.join(root, "env"), per_device_train_batch_size=BATCH)
    trainer, res = run(Trainer, model, args)
    res.update(sharding(trainer), accelerate_fsdp=trainer.is_fsdp_enabled)
    save_params(trainer.model, os.path.join(root, "env.pt"))
    out["env"] = res

    # 2. load_best_model_at_end: the best checkpoint is an early one, loaded back into the sharded model.
    args = targs(TrainingArguments, os.path.join(root, "best"), per_device_train_batch_size=BATCH, **BEST)
    trainer, out["best"] = run(Trainer, tiny_model(), args)
    save_params(trainer.model, os.path.join(root, "best.pt"))

    # 3. Resume the MindSpeedTrainer run of `train`: its newest complete checkpoint is checkpoint-2.
    ms_dir = os.path.join(root, "ms")
    args = targs(TrainingArguments, ms_dir, per_device_train_batch_size=BATCH, save_strategy="steps", save_steps=2)
    trainer = MindSpeedTrainer(model=tiny_model(), args=args, train_dataset=dataset(), data_collator=collate)
    try:
        trainer.train(resume_from_checkpoint=os.path.join(ms_dir, "checkpoint-3"))
        out["incomplete_error"] = None
    except ValueError as err:
        out["incomplete_error"] = str(err)
    rec = recorder()
    trainer.add_callback(rec)
    trainer.train(resume_from_checkpoint=True)
    out["resume"] = {"losses": rec.losses, "grad_norms": rec.grad_norms, "steps": trainer.state.global_step}
    save_params(trainer.model, os.path.join(root, "resume.pt"))
    if rank == 0:
        out["resume"]["dirs"] = sorted(os.listdir(ms_dir))
        out["resume"]["complete"] = sorted(d for d in out["resume"]["dirs"]
                                           if os.path.isfile(os.path.join(ms_dir, d, "COMPLETE")))
    return out


def scenario_hsdp(root: str) -> dict:
    """4 ranks: 2 replicas x 2 shards, gradient accumulation 2 (reduce-scatter per micro-batch is deferred)."""
    from mindspeed_hf.trainers import MindSpeedTrainer, MindSpeedTrainingArguments, run_of

    off = {f"mindspeed_{k}": v for k, v in KERNELS_OFF.items()}
    args = targs(MindSpeedTrainingArguments, os.path.join(root, "hsdp"), per_device_train_batch_size=BATCH,
                 mindspeed_dp_replicate=2, **GA2, **off)
    trainer, res = run(MindSpeedTrainer, tiny_model(), args)
    dims = run_of(trainer).dims
    res.update(sharding(trainer), dims=[dims.dp_replicate, dims.dp_shard])
    save_params(trainer.model, os.path.join(root, "hsdp.pt"))
    return {"hsdp": res}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["reference", "train", "env", "hsdp"])
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.scenario == "reference":
        result = scenario_reference(a.root)
    else:
        dist.init_process_group("gloo")
        result = {"train": scenario_train, "env": scenario_env, "hsdp": scenario_hsdp}[a.scenario](a.root)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
