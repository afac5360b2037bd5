"""Worker for tests/distributed/test_qwen3_tts_fsdp.py: the Qwen3-TTS example objective (examples/qwen3_tts) under
HF Trainer, one plain process (no mindspeed_hf) or 2 ranks with FSDP2 through TrainingArguments and mindspeed_hf's
kernels, on the same global batch. Every row has the same text and frame count, so each rank's mean loss is the
global mean's half. Rank 0 writes the per-step losses (averaged over ranks, unrounded) to --out and the final full
parameters next to it (.pt)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "examples" / "qwen3_tts")]

STEPS, BATCH = 3, 2  # BATCH per rank; the plain run uses 2 * BATCH


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["plain", "fsdp"])
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    fsdp = opts.scenario == "fsdp"
    if fsdp:
        import mindspeed_hf

        mindspeed_hf.enable()
    from data import Collator, synthetic_rows
    from tiny_models import tiny_tts_model
    from transformers import Trainer, TrainingArguments
    from tts_loss import Qwen3TTSFinetune

    model = tiny_tts_model()
    module = Qwen3TTSFinetune(model)
    initial = {n: p.detach().clone() for n, p in module.named_parameters()}
    losses: list[float] = []
    module.register_forward_hook(lambda mod, args, kwargs, out: losses.append(float(out["loss"])), with_kwargs=True)
    extra = dict(fsdp=True, fsdp_config={"fsdp_version": 2}) if fsdp else {}
    args = TrainingArguments(output_dir=str(Path(opts.out).parent / opts.scenario), max_steps=STEPS,
                             per_device_train_batch_size=BATCH * (1 if fsdp else 2), optim="sgd", learning_rate=0.2,
                             logging_steps=1, report_to="none", disable_tqdm=True, seed=0, save_strategy="no",
                             remove_unused_columns=False, dataloader_drop_last=True, **extra)
    rows = synthetic_rows(model.config, 16, text_len=(8, 8), frames=(10, 10))
    trainer = Trainer(model=module, args=args, train_dataset=rows, data_collator=Collator(model.config))
    trainer.train()
    steps = torch.tensor(losses)
    if dist.is_initialized():
        dist.all_reduce(steps)
        steps /= dist.get_world_size()
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for n, p in trainer.model.named_parameters()}
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(params, opts.out + ".pt")
        report = __import__("mindspeed_hf").report(trainer.model)
        moved = max(float((params[n] - initial[n]).abs().max()) for n in params)
        Path(opts.out).write_text(json.dumps({"losses": steps.tolist(), "kernels": report["kernels"], "moved": moved,
                                              "dtensor": any(isinstance(p, DTensor)
                                                             for p in trainer.model.parameters())}))


if __name__ == "__main__":
    main()
