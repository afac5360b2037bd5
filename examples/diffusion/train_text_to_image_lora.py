"""Text-to-image LoRA fine-tuning of a Flux transformer, in the shape of diffusers' official
train_dreambooth_lora_flux.py: Accelerator, `add_adapter(LoraConfig(...))` on the frozen transformer, `prepare`,
flow matching with compute_density_for_timestep_sampling / compute_loss_weighting_for_sd3, accelerator.backward,
gradient accumulation and clipping. A tiny Flux from config and embedded cached latents / text embeddings (no
download). The one line mindspeed_hf adds is the import:

    python examples/diffusion/train_text_to_image_lora.py --max_train_steps 30
    MINDSPEED_HF_AUTO=0 python examples/diffusion/train_text_to_image_lora.py     # plain diffusers
    MINDSPEED_HF_BACKEND=npu ...                                                  # the NPU path (stand-in on CPU)

Prints {"step", "loss"} JSON lines (or writes them to --losses_file), then {"enabled", "report"}.
"""

import mindspeed_hf  # noqa: F401  (the one added line; MINDSPEED_HF_AUTO=0 imports it without patching)

# isort: split
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from diffusers import FluxTransformer2DModel
from diffusers.optimization import get_scheduler
from peft import LoraConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny  # noqa: E402

LATENT = (4, 8, 8)  # channels, height, width of the (cached) VAE latents


def tiny_flux() -> FluxTransformer2DModel:
    return FluxTransformer2DModel(patch_size=1, in_channels=4 * LATENT[0], num_layers=1, num_single_layers=2,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=tiny.TEXT_DIM,
                                  pooled_projection_dim=tiny.TEXT_DIM, axes_dims_rope=(4, 6, 6))


def main(argv: list[str] | None = None) -> list[float]:
    args = tiny.arguments(__doc__.splitlines()[0]).parse_args(argv)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              mixed_precision=args.mixed_precision)
    set_seed(args.seed)
    transformer = tiny_flux()
    transformer.requires_grad_(False)
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    transformer.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, init_lora_weights="gaussian",
                                       target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate)
    data = torch.utils.data.DataLoader(tiny.dataset(args.num_examples, LATENT), batch_size=args.train_batch_size,
                                       shuffle=True, collate_fn=tiny.collate,
                                       generator=torch.Generator().manual_seed(args.seed))
    lr_scheduler = get_scheduler("constant", optimizer=optimizer)
    transformer, optimizer, data, lr_scheduler = accelerator.prepare(transformer, optimizer, data, lr_scheduler)
    scheduler = tiny.noise_scheduler()
    img_ids = tiny.image_ids(*LATENT[1:])
    txt_ids = torch.zeros(tiny.TEXT_TOKENS, 3)
    out, losses, step = tiny.JsonLines(args.losses_file), [], 0
    while step < args.max_train_steps:
        for batch in data:
            with accelerator.accumulate(transformer):
                latents = tiny.pack(batch["latents"])
                noisy, timesteps, target, weighting = tiny.noisy_latents(args, scheduler, latents, batch["index"],
                                                                         step)
                pred = transformer(hidden_states=noisy, timestep=timesteps / 1000,
                                   encoder_hidden_states=batch["prompt_embeds"],
                                   pooled_projections=batch["pooled_prompt_embeds"], img_ids=img_ids,
                                   txt_ids=txt_ids, return_dict=False)[0]
                loss = tiny.flow_matching_loss(pred, target, weighting)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(params, 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                # as diffusers' scripts log it: the mean over the processes' examples
                losses.append(accelerator.gather(loss.detach().repeat(args.train_batch_size)).mean().item())
                out.write(step=step, loss=losses[-1])
                if step >= args.max_train_steps:
                    break
    tiny.emit_report(out, transformer)
    out.close()
    return losses


if __name__ == "__main__":
    main()
