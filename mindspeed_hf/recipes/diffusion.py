"""`mindspeed-hf train --recipe diffusion`: the embedded text-to-image LoRA run.

A tiny Flux transformer built from config learns, through LoRA adapters on its attention projections, the latent
pattern of each of four prompts (recipes/diffusion_data.py: cached latents and text embeddings, as diffusers' scripts
keep them). The loop is the one of diffusers' official LoRA scripts: Accelerator, `add_adapter(LoraConfig(...))`,
`prepare`, flow matching with compute_density_for_timestep_sampling / compute_loss_weighting_for_sd3,
accelerator.backward, gradient clipping. It prints the held-out flow-matching loss (fixed noise and timesteps)
before and after training, and writes the transformer with the adapters fused in, which
`FluxTransformer2DModel.from_pretrained` loads. Any `--<TrainingArguments key> VALUE` overrides the recipe's
settings (max_steps, learning_rate, per_device_train_batch_size, gradient_accumulation_steps, max_grad_norm,
logging_steps, seed, output_dir).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..device import detect_device_type, peak_memory_bytes, reset_peak_memory
from . import diffusion_data as data
from .run_config import build_training_args
from .summary import applied, is_rank_zero, print_summary
from .text import write_metrics
from .vl import recipe_run_config

logger = logging.getLogger("mindspeed_hf")

LOADER = "FluxTransformer2DModel"
LATENT = (4, 8, 8)  # channels, height, width of the cached latents
N_TRAIN, N_EVAL = 256, 32
TRAINING = {
    "output_dir": "./mindspeed_hf_diffusion_output",
    "max_steps": 150,
    "per_device_train_batch_size": 8,
    "learning_rate": 1.0e-2,
    "max_grad_norm": 1.0,
    "logging_steps": 25,
    "save_strategy": "no",
    "report_to": "none",
    "seed": 0,
}
LORA_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]


def diffusion_training_args(overrides: list[str] | None = None) -> Any:
    """The recipe's TrainingArguments with `--key value` overrides; built (and checked) before any model."""
    import mindspeed_hf

    run = recipe_run_config("diffusion", "flux", TRAINING)
    return build_training_args(run, overrides or [], mindspeed_hf.is_enabled())


def tiny_flux() -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(patch_size=1, in_channels=4 * LATENT[0], num_layers=1, num_single_layers=2,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=data.TEXT_DIM,
                                  pooled_projection_dim=data.TEXT_DIM, axes_dims_rope=(4, 6, 6))


def _predict(model: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
             batch: dict[str, torch.Tensor]) -> torch.Tensor:
    device = noisy.device
    return model(hidden_states=noisy, timestep=timesteps / 1000, encoder_hidden_states=batch["prompt_embeds"],
                 pooled_projections=batch["pooled_prompt_embeds"], img_ids=data.image_ids(*LATENT[1:]).to(device),
                 txt_ids=torch.zeros(data.TEXT_TOKENS, 3, device=device), return_dict=False)[0]


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, rows: list[dict[str, torch.Tensor]], device: torch.device) -> float:
    """The flow-matching loss on the held-out rows with fixed noise and timesteps (the same before and after)."""
    was_training = model.training
    model.eval()
    try:
        batch = {k: v.to(device) for k, v in data.collate(rows).items()}
        latents = data.pack(batch["latents"])
        noisy, timesteps, target, weighting = data.noisy_latents(
            latents, data.noise_scheduler(), generator=torch.Generator().manual_seed(data.DATA_SEED))
        return float(data.flow_matching_loss(_predict(model, noisy, timesteps, batch), target, weighting))
    finally:
        model.train(was_training)


def run_diffusion_training(args: Any = None, metrics_file: str | None = None, quality_eval: bool = True
                           ) -> dict[str, Any]:
    """Run the recipe with `args` (default: diffusion_training_args()); prints and returns (and optionally writes)
    the metrics of the text run (held-out loss in place of the exact match)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from diffusers.optimization import get_scheduler
    from peft import LoraConfig

    import mindspeed_hf

    args = args if args is not None else diffusion_training_args()
    if args.resume_from_checkpoint:
        raise ValueError("--resume_from_checkpoint: the diffusion recipe saves no training checkpoints to resume "
                         "from; valid choices: leave it out")
    started = time.perf_counter()
    device_type = detect_device_type()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, cpu=device_type == "cpu")
    set_seed(args.seed)
    model = tiny_flux()
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian", target_modules=LORA_TARGETS))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    loader = torch.utils.data.DataLoader(data.dataset(N_TRAIN, LATENT), batch_size=args.per_device_train_batch_size,
                                         shuffle=True, collate_fn=data.collate,
                                         generator=torch.Generator().manual_seed(args.seed))
    lr_scheduler = get_scheduler("constant", optimizer=optimizer)
    model, optimizer, loader, lr_scheduler = accelerator.prepare(model, optimizer, loader, lr_scheduler)
    eval_rows = data.dataset(N_EVAL, LATENT, offset=1)
    before = {"eval_loss": held_out_loss(model, eval_rows, accelerator.device), "exact_match": None,
              "num_prompts": N_EVAL} if quality_eval else None
    scheduler = data.noise_scheduler()
    losses: dict[str, float] = {}
    step, train_started = 0, time.perf_counter()
    reset_peak_memory(device_type)
    while step < args.max_steps:
        for batch in loader:
            with accelerator.accumulate(model):
                noisy, timesteps, target, weighting = data.noisy_latents(data.pack(batch["latents"]), scheduler)
                loss = data.flow_matching_loss(_predict(model, noisy, timesteps, batch), target, weighting)
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm:
                    accelerator.clip_grad_norm_(params, args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            if step % args.logging_steps == 0 or step == args.max_steps:
                losses[str(step)] = loss.item()
                if is_rank_zero():
                    logger.info("mindspeed-hf train: step %d loss %.4f", step, losses[str(step)])
            if step >= args.max_steps:
                break
    runtime = time.perf_counter() - train_started
    after = {"eval_loss": held_out_loss(model, eval_rows, accelerator.device), "exact_match": None,
             "num_prompts": N_EVAL} if quality_eval else None
    denoiser = accelerator.unwrap_model(model)
    report = mindspeed_hf.report(denoiser)
    if accelerator.is_main_process:
        denoiser.fuse_lora(lora_scale=1.0)  # the adapters into the weights: a plain Flux checkpoint
        denoiser.unload_lora()
        denoiser.save_pretrained(args.output_dir)
    result = {"accelerated": mindspeed_hf.is_enabled(), "device": device_type, "model_type": "flux",
              "params": sum(p.numel() for p in denoiser.parameters()), "report": report, "applied": applied(report),
              "steps": step, "steps_run": step, "losses": losses, "train_loss": None, "tokens_per_s": None,
              "peak_memory_bytes": peak_memory_bytes(device_type), "train_runtime_s": runtime,
              "total_runtime_s": time.perf_counter() - started, "before": before, "after": after,
              "output_dir": str(args.output_dir), "loader": LOADER}
    print_summary(result)
    write_metrics(result, metrics_file)
    return result
