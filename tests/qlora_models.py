"""QLoRA models for the tests: a tiny model saved once, reloaded 4-bit (bitsandbytes NF4) the way QLoRA scripts do
it, prepared for k-bit training and wrapped with PEFT LoRA on every linear layer; and a few AdamW steps that record
the losses and LoRA gradients of each step."""

from __future__ import annotations

import torch
from tiny_models import padded_batch, tiny_model


def save_base(path, model_type: str = "qwen3", **overrides) -> str:
    tiny_model(model_type, **overrides).save_pretrained(path)
    return str(path)


def qlora_model(path: str, *, compute_dtype: torch.dtype = torch.float32, quant_storage: torch.dtype = torch.uint8,
                quantize_lm_head: bool = False, gradient_checkpointing: bool = True, seed: int = 3):
    """from_pretrained(BitsAndBytesConfig 4-bit NF4, double quant) -> prepare_model_for_kbit_training -> LoRA
    (all-linear, non-zero B so every adapter matters from the first step), in training mode."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=quant_storage,
        llm_int8_skip_modules=[] if quantize_lm_head else None,
    )
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, device_map="cpu",
                                                 dtype=compute_dtype)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    torch.manual_seed(seed)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                                             init_lora_weights=False, task_type="CAUSAL_LM"))
    model.train()
    return model


def step_batch(step: int, batch: int = 3) -> dict[str, torch.Tensor]:
    return padded_batch(batch=batch, seed=10 + step)


def lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def train_steps(model, steps: int = 3, lr: float = 1e-2) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """`steps` AdamW steps on the trainable (LoRA) parameters: each step's loss and gradients."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses, grads = [], []
    for step in range(steps):
        loss = model(**step_batch(step)).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(lora_grads(model))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, grads
