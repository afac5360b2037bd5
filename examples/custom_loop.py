"""A plain accelerate training loop (the shape of transformers' `run_clm_no_trainer.py`): `Accelerator`, `prepare`,
`accelerator.backward`, `save_state` / `load_state`. The only mindspeed_hf line is the import below; parallel sizes
and memory features come from MINDSPEED_HF_CONFIG, MINDSPEED_HF_* variables or an `accelerate launch` config.

    python examples/custom_loop.py --max_steps 10
    MINDSPEED_HF_AUTO=0 python examples/custom_loop.py --max_steps 10            # the same loop, plain HF
    MINDSPEED_HF_PARALLEL_CP=2 torchrun --nproc_per_node 2 examples/custom_loop.py
    accelerate launch --config_file examples/accelerate/cpu_fsdp2.yaml examples/custom_loop.py

It trains the tiny Qwen3-architecture model shipped with the package (or a tiny Qwen3-MoE with --moe) on the
shipped instruction data, concatenated and cut into blocks of --block_size tokens as run_clm does, and prints one
JSON line per optimizer step: {"step": n, "loss": x} with the loss averaged over the processes.
"""

import mindspeed_hf  # noqa: F401  (the one line mindspeed_hf needs; MINDSPEED_HF_AUTO=0 leaves it off)

# isort: split
import argparse
import json
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from common import JsonLines, load_tokenizer, read_rows, tiny_model
from torch.utils.data import DataLoader
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM, get_scheduler


def blocks(tokenizer, rows: int, block_size: int) -> list[dict[str, torch.Tensor]]:
    """run_clm's group_texts: every row's text tokenised, concatenated, cut into full blocks; labels = inputs."""
    ids: list[int] = []
    for row in read_rows(rows):
        ids += tokenizer(row["prompt"] + " " + row["completion"])["input_ids"] + [tokenizer.eos_token_id]
    n = len(ids) // block_size
    return [{"input_ids": torch.tensor(ids[i * block_size:(i + 1) * block_size])} for i in range(n)]


def collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    input_ids = torch.stack([x["input_ids"] for x in batch])
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def tiny_moe(tokenizer, seed: int = 0) -> Qwen3MoeForCausalLM:
    """A tiny Qwen3-MoE model (4 experts, 2 per token), initialised from `seed`."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id)
    return Qwen3MoeForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=10)
    parser.add_argument("--batch_size", type=int, default=4, help="rows per process and step")
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--rows", type=int, default=256, help="rows of the shipped dataset to read")
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--moe", action="store_true", help="a tiny Qwen3-MoE model instead of the dense one")
    parser.add_argument("--untied", action="store_true", help="the dense model's lm_head apart from its embeddings "
                        "(tensor parallelism shards them apart)")
    parser.add_argument("--output_dir", default="./custom_loop_output")
    parser.add_argument("--save_state_steps", type=int, default=0, help="save_state every N steps (0: never)")
    parser.add_argument("--resume_from", default=None, help="a save_state directory to load_state from")
    parser.add_argument("--save_model", action="store_true", help="write the trained model to OUTPUT_DIR/final")
    parser.add_argument("--losses_file", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              project_config=ProjectConfiguration(project_dir=args.output_dir))
    set_seed(args.seed)
    tokenizer = load_tokenizer()
    model = tiny_moe(tokenizer, args.seed) if args.moe else tiny_model(tokenizer, args.seed, tied=not args.untied)
    data = blocks(tokenizer, args.rows, args.block_size)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, collate_fn=collate,
                        generator=torch.Generator().manual_seed(args.seed))
    optimizer = (torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.SGD)(model.parameters(),
                                                                                      lr=args.learning_rate)
    # accelerate steps a prepared scheduler once per process per optimizer step: count its steps as run_clm does
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0,
                              num_training_steps=args.max_steps * accelerator.num_processes)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    step, skip = 0, 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        step = int(os.path.basename(os.path.normpath(args.resume_from)).rpartition("_")[2])
        skip = step * args.gradient_accumulation_steps
    out = JsonLines(args.losses_file)
    epochs = math.ceil(args.max_steps * args.gradient_accumulation_steps / max(len(loader), 1))
    model.train()
    for epoch in range(epochs):
        batches = loader
        if skip >= len(loader):  # a whole epoch already trained before the restart
            skip -= len(loader)
            continue
        if skip:
            batches, skip = accelerator.skip_first_batches(loader, skip), 0
        for batch in batches:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            out.write(step=step, loss=accelerator.gather(loss.detach()).mean().item(), epoch=epoch)
            if args.save_state_steps and step % args.save_state_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{step}"))
            if step >= args.max_steps:
                break
        if step >= args.max_steps:
            break
    if args.save_model:  # as run_clm_no_trainer does; get_state_dict gathers a sharded model (every rank calls it)
        state_dict = accelerator.get_state_dict(model)
        accelerator.unwrap_model(model).save_pretrained(os.path.join(args.output_dir, "final"), state_dict=state_dict,
                                                        is_main_process=accelerator.is_main_process,
                                                        save_function=accelerator.save)
    if accelerator.is_main_process:
        print(json.dumps({"report": mindspeed_hf.report(accelerator.unwrap_model(model))}), flush=True)
    accelerator.end_training()  # last: it ends the process group


if __name__ == "__main__":
    main()
