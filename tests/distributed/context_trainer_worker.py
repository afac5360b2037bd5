"""Worker for tests/distributed/test_context_parallel.py's Trainer runs: a plain transformers Trainer script, unchanged,
with context parallelism from MINDSPEED_HF_CONFIG (torchrun, gloo, CPU, fp32), and its single-process reference.

  reference (one process, plain HF, no mindspeed_hf): Trainer on the global batch (GLOBAL rows per step, GLOBAL / ga
            per micro-batch).
  cp        (torchrun; sizes from MINDSPEED_HF_CONFIG): the same script after `import mindspeed_hf`; each rank's
            micro-batch is GLOBAL / (dp x ga) rows (the data is split over dp only, the sequence across cp).
Rank 0 writes the logged losses and grad norms, the loss of `trainer.evaluate` on held-out rows after training, what
`trainer.predict` on them raised (None: it ran) and the final parameters (gathered) to --out (.json / .pt).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from trainer_worker import collate, dataset  # uneven lengths, masked prompts, right padding

STEPS, GLOBAL = 3, 8
EVAL_ROWS = 4  # one evaluation batch over the dp ranks


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=128, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        use_cache=False))  # with a cache, transformers 4.57's sdpa does not see the packed documents


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["reference", "cp"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--ga", type=int, default=1)
    parser.add_argument("--packed", action="store_true", help="DataCollatorWithFlattening (padding-free packing)")
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
                             per_device_eval_batch_size=EVAL_ROWS // opts.dp,
                             gradient_accumulation_steps=opts.ga, max_grad_norm=0.5, logging_steps=1,
                             report_to="none", disable_tqdm=True, seed=0, save_strategy="no",
                             dataloader_drop_last=True, use_cpu=True)
    record = Record()
    if opts.packed:
        from transformers import DataCollatorWithFlattening

        collator = DataCollatorWithFlattening()
    else:
        collator = collate
    trainer = Trainer(model=tiny_model(), args=args, train_dataset=dataset(), data_collator=collator,
                      callbacks=[record])
    trainer.train()
    evaluated = trainer.evaluate(eval_dataset=dataset(n=EVAL_ROWS, seed=2))  # the trained model, held-out rows
    predict_error = None
    try:  # predictions: refused under cp (each rank's logits are a slice of every sequence)
        trainer.predict(dataset(n=EVAL_ROWS, seed=2))
    except ValueError as error:
        predict_error = str(error)
    from torch.distributed.tensor import DTensor

    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for n, p in trainer.model.named_parameters()}
    if trainer.args.process_index == 0:
        torch.save(params, opts.out + ".pt")
        dims = None
        if "mindspeed_hf.trainers" in sys.modules:  # the accelerated run: its mesh
            from mindspeed_hf.trainers import run_of

            dims = getattr(run_of(trainer), "dims", None)
        facts = {"attention": trainer.model.config._attn_implementation, "eval_loss": evaluated["eval_loss"],
                 "predict_error": predict_error,
                 "cp": dims.cp if dims else 1, "dp": dims.dp_size if dims else 1}
        with open(opts.out, "w") as f:
            json.dump({"losses": record.losses, "grad_norms": record.grad_norms, **facts}, f)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
