"""Worker for tests/distributed/test_context_parallel.py's Trainer runs: a plain transformers Trainer script, unchanged,
with context parallelism from MINDSPEED_HF_CONFIG (torchrun, gloo, CPU, fp32), and its single-process reference.

  reference (one process, plain HF, no mindspeed_hf): Trainer on the global batch (GLOBAL rows per step).
  cp        (torchrun; sizes from MINDSPEED_HF_CONFIG): the same script after `import mindspeed_hf`; each rank's
            loader batch is GLOBAL / dp rows (the data is split over dp only, the sequence across cp).
Rank 0 writes the logged losses and grad norms and the final parameters (gathered) to --out (.json / .pt).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

STEPS, GLOBAL, SEQ, N = 3, 4, 23, 48


def dataset(n: int = N, seed: int = 1) -> list[dict[str, list[int]]]:
    """Uneven lengths, masked prompts: different numbers of loss tokens on every rank and row."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = 8 + int(torch.randint(0, SEQ - 8, (1,), generator=g))
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


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=128, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["reference", "cp"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--ga", type=int, default=1)
    opts = parser.parse_args()
    if opts.scenario == "cp":
        import mindspeed_hf  # noqa: F401 - the drop-in: plain Trainer below is wired
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Record(TrainerCallback):
        losses: list[float] = []
        grad_norms: list[float] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))
                self.grad_norms.append(float(logs["grad_norm"]))

    args = TrainingArguments(output_dir=opts.out + ".dir", max_steps=STEPS, optim="sgd", learning_rate=0.5,
                             per_device_train_batch_size=GLOBAL // (opts.dp * opts.ga),
                             gradient_accumulation_steps=opts.ga, max_grad_norm=0.5, logging_steps=1,
                             report_to="none", disable_tqdm=True, seed=0, save_strategy="no",
                             dataloader_drop_last=True, use_cpu=True)
    record = Record()
    trainer = Trainer(model=tiny_model(), args=args, train_dataset=dataset(), data_collator=collate, callbacks=[record])
    trainer.train()
    from torch.distributed.tensor import DTensor

    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for n, p in trainer.model.named_parameters()}
    if trainer.args.process_index == 0:
        torch.save(params, opts.out + ".pt")
        state = getattr(trainer, "_mindspeed_fsdp", None)
        facts = {"attention": trainer.model.config._attn_implementation,
                 "cp": state.dims.cp if state else 1, "dp": state.dims.dp_size if state else 1}
        with open(opts.out, "w") as f:
            json.dump({"losses": record.losses, "grad_norms": record.grad_norms, **facts}, f)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
