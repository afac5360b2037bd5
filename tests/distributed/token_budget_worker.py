"""torchrun worker (gloo, 2 ranks): a plain Trainer script with `data.max_tokens_per_batch` from the environment
(MINDSPEED_HF_DATA_MAX_TOKENS_PER_BATCH), 2 epochs saving at step 2; every rank records the rows of each batch it
trained on; then a second Trainer resumes from checkpoint-2 and records its batches too. Rank 0 writes them all to
--out."""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist
from test_token_budget import _documents, _pad, _Recording, _rows
from tiny_models import tiny_model
from transformers import Trainer, TrainingArguments

import mindspeed_hf  # noqa: F401  (the drop-in import)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = ap.parse_args().out
    torch.set_num_threads(1)
    def train(resume: str | None = None) -> list:
        collator = _Recording(_pad)
        args = TrainingArguments(output_dir=f"{out}.run", num_train_epochs=2, learning_rate=1e-3, report_to="none",
                                 use_cpu=True, seed=0, disable_tqdm=True, save_strategy="steps", save_steps=2,
                                 dataloader_pin_memory=False)
        Trainer(model=tiny_model("qwen3"), args=args, train_dataset=_rows(),
                data_collator=collator).train(resume_from_checkpoint=resume)
        return collator.batches

    batches = train()
    resumed = train(f"{out}.run/checkpoint-2")
    mine = {"batches": [_documents(b) for b in batches], "tokens": [b["input_ids"].numel() for b in batches],
            "resumed": [_documents(b) for b in resumed]}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"ranks": everyone, "rows": [r["input_ids"] for r in _rows()]}, f)
    dist.barrier()


if __name__ == "__main__":
    sys.exit(main())
