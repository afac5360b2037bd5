"""Worker for tests/distributed/test_context_parallel_vlm.py: a plain transformers Trainer script, unchanged, on a tiny
Qwen-VL model (rows with images of different grids, rows without) or Omni thinker (audio clips too: tests/tiny_omni),
context parallelism from MINDSPEED_HF_CONFIG
(torchrun, gloo, CPU, fp32), and its single-process plain-HF reference.

  reference (one process, plain HF, no kernels): Trainer on the global batch (GLOBAL rows per step).
  sharded   (torchrun; sizes from MINDSPEED_HF_CONFIG): the same script after `import mindspeed_hf`; each rank's
            micro-batch is GLOBAL / dp rows (the data is split over dp only, the sequence across cp).
Rows are right-padded (tests/tiny_vlms.pad_rows) or packed (mindspeed_hf.data.FlatteningCollator, one row per
micro-batch). Rank 0 writes the logged losses and grad norms (--out, JSON), the final parameters (gathered, .pt)
and what ran (attention implementations, the kernels report).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_vlms

from tiny_omni import OMNI_TYPES, omni_rows, tiny_omni_thinker  # noqa: E402
from tiny_vlms import pad_rows, tiny_vlm, vlm_rows  # noqa: E402
from trainer_worker import recorder  # noqa: E402

STEPS, GLOBAL = 3, 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["reference", "sharded"])
    parser.add_argument("--model", default="qwen2_5_vl")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--packed", action="store_true", help="FlatteningCollator (rows packed into one)")
    parser.add_argument("--videos", action="store_true", help="rows with videos too (tiny_vlms.vlm_rows)")
    parser.add_argument("--deepspeed", choices=["zero2", "zero3"],
                        help="this DeepSpeed stage (deepspeed_worker's config), not sizes from MINDSPEED_HF_CONFIG")
    parser.add_argument("--checkpointing", action="store_true",
                        help="gradient_checkpointing=True (under DDP Trainer then sets find_unused_parameters=False)")
    parser.add_argument("--rank0-forward", action="store_true",
                        help="after training, a no_grad forward on rank 0 alone (legal under DDP: no collective)")
    parser.add_argument("--token-mean", action="store_true",
                        help="model.accepts_loss_kwargs = True: Qwen-VL declares False, so Trainer would average the "
                             "dp ranks' per-rank mean losses instead of taking the token mean one process takes")
    opts = parser.parse_args()
    if opts.scenario == "sharded":
        import mindspeed_hf  # noqa: F401 - the drop-in: plain Trainer below is wired
    from transformers import Trainer, TrainingArguments

    from mindspeed_hf.data import FlatteningCollator

    omni = opts.model in OMNI_TYPES
    model = tiny_omni_thinker(opts.model) if omni else tiny_vlm(opts.model)
    if opts.token_mean:
        model.accepts_loss_kwargs = True
    rows = omni_rows(model, count=STEPS * GLOBAL) if omni else vlm_rows(model, count=STEPS * GLOBAL,
                                                                        videos=opts.videos)
    extra = {}
    if opts.deepspeed:
        from deepspeed_worker import STAGES, ds_config  # (no DeepSpeed C++ build: see there)

        extra["deepspeed"] = ds_config(STAGES[opts.deepspeed])
    if opts.checkpointing:
        extra["gradient_checkpointing"] = True
    args = TrainingArguments(**extra, output_dir=opts.out + ".dir", max_steps=STEPS, optim="sgd", learning_rate=0.5,
                             per_device_train_batch_size=GLOBAL // opts.dp, max_grad_norm=0.5, logging_steps=1,
                             report_to="none", disable_tqdm=True, seed=0, save_strategy="no",
                             dataloader_drop_last=True, use_cpu=True, remove_unused_columns=False)
    record = recorder()
    seen: dict[str, list[int]] = {"full": [], "text": []}  # sequence lengths: the batch's, the first text layer's
    model.register_forward_pre_hook(lambda m, a, k: seen["full"].append(k["input_ids"].shape[1]), with_kwargs=True)
    model.model.language_model.layers[0].register_forward_pre_hook(
        lambda m, a, k: seen["text"].append((a[0] if a else k["hidden_states"]).shape[1]), with_kwargs=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[record],
                      data_collator=FlatteningCollator() if opts.packed else pad_rows)
    trainer.train()
    if opts.rank0_forward and trainer.args.process_index == 0:
        with torch.no_grad():
            model(**pad_rows([row for row in rows if "pixel_values" not in row][:1]))
    from torch.distributed.tensor import DTensor

    # forwards that ran a tower on a placeholder (a medium this rank's micro-batch lacked), summed over the ranks
    state = getattr(model, "_mindspeed_media_state", None)
    placeholders = torch.tensor([state.ran[key] for key in sorted(state.ran)] if state else [0, 0, 0])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(placeholders)
    with contextlib.ExitStack() as stack:
        if opts.deepspeed == "zero3":  # ZeRO-3 partitions every parameter: gathered whole for the copy
            import deepspeed

            stack.enter_context(deepspeed.zero.GatheredParameters(list(trainer.model.parameters())))
        params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                  for n, p in trainer.model.named_parameters()}
    if trainer.args.process_index == 0:
        torch.save(params, opts.out + ".pt")
        facts = {"lengths": seen, "text_attention": model.config.text_config._attn_implementation,
                 "vision_attention": model.config.vision_config._attn_implementation}
        if opts.scenario == "sharded":
            from mindspeed_hf.trainers import run_of

            dims = run_of(trainer).dims  # None: one process, no parallel sizes
            report = mindspeed_hf.report(trainer.model)
            marked = {key: sum(hasattr(m, f"_mindspeed_{key}") for m in trainer.model.modules())
                      for key in ("recompute", "offload")}  # modules selective recompute / offload wrapped
            facts.update(cp=dims.cp if dims else 1, dp=dims.dp_size if dims else 1, ep=dims.ep if dims else 1,
                         replicate=dims.dp_replicate if dims else 1,
                         audio_kernels=report.get("audio_kernels"), memory=marked,
                         placeholders=dict(zip(sorted(state.ran), placeholders.tolist())) if state else {},
                         ran=report["ran"], implementations=report["implementations"],
                         vision_implementation=report.get("vision_attention_implementation"),
                         vision_shared=getattr(model.model.visual, "_mindspeed_cp_vision", {}).get("shared", 0))
        with open(opts.out, "w") as f:
            json.dump({"losses": record.losses, "grad_norms": record.grad_norms, **facts}, f)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
