"""Training loops of the expert-parallel tests (expert_worker.py): the batches, the models (with a forced router
bias or LoRA), one process on the global batch (`ref_run`), the sharded run (`ep_run`, each rank its slice) and
their comparison (`compare`)."""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_models import tiny_model
from torch.distributed.tensor import DTensor

from mindspeed_hf.parallel.expert import clip_grad_norm_

GLOBAL_BATCH, SEQ, VOCAB, LR, MAX_NORM = 4, 12, 128, 1e-3, 0.5


def batch(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 + 10 * step + micro)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, 8:] = -100  # uneven valid-token counts across ranks
    labels[GLOBAL_BATCH - 1, :5] = -100
    return ids, labels


def biased_router(bias: torch.Tensor):
    """A softmax-top-k router (qwen3_moe / mixtral) whose logits get `bias` before the top-k: forces imbalance.
    Installed the same on the reference and the sharded model."""

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight) + bias
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top_value, top_index = torch.topk(probs, self.top_k, dim=-1)
        if getattr(self, "norm_topk_prob", True):
            top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        return logits, top_value.to(logits.dtype), top_index

    return forward


#: LoRA on the fused expert weights themselves (PEFT target_parameters) and on an attention projection
EXPERT_LORA = {"target_modules": ["q_proj"], "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


def build(family: str, bias: list[float] | None = None, lora: dict | None = None, **overrides):
    model = tiny_model(family, **overrides)
    if bias is not None:
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter"):
                module.forward = types.MethodType(biased_router(torch.tensor(bias)), module)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **lora))
        with torch.no_grad():  # non-zero B so the adapter matters from step 0
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(std=0.05)
    return model


def make_opt(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def micro_loss(model, step, micro, sl, accum):
    ids, labels = batch(step, micro)
    n = sum((batch(step, m)[1][:, 1:] != -100).sum() for m in range(accum))  # tokens of the whole step
    return model(input_ids=ids[sl], labels=labels[sl], num_items_in_batch=n).loss


def full_grads(model) -> dict[str, torch.Tensor]:
    """Gradients as one process would hold them (collective for DTensors)."""
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in model.named_parameters() if p.grad is not None}


def ref_run(model, steps, accum):
    opt, losses, norms, grads = make_opt(model), [], [], {}
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            loss = micro_loss(model, step, micro, slice(None), accum)
            loss.backward()
            total += loss.item()
        grads = grads or full_grads(model)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms, grads


def ep_run(model, dims, steps, accum):
    opt, losses, norms, grads = make_opt(model), [], [], {}
    per = GLOBAL_BATCH // dims.dp_size
    rank = dist.get_rank()
    sl = slice(rank * per, (rank + 1) * per)
    for step in range(steps):
        total = torch.zeros(())
        for micro in range(accum):
            model.set_requires_gradient_sync(micro == accum - 1)
            loss = micro_loss(model, step, micro, sl, accum)
            (loss * dims.dp_size).backward()  # FSDP averages gradients over the data ranks
            total += loss.detach()
        dist.all_reduce(total)
        grads = grads or full_grads(model)
        norms.append(clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(total.item())
    return losses, norms, grads


def compare(ref, grads, got, steps, accum) -> dict:
    """Train `ref` in one process on the global batch; its losses, grad norms, gradients and final parameters
    against the sharded run's `grads` / `got`."""
    out = {}
    out["ref_losses"], out["ref_norms"], ref_grads = ref_run(ref, steps, accum)
    out["grad_max_diff"] = max((grads[k] - g).abs().max().item() for k, g in ref_grads.items())
    out["same_grads"] = sorted(grads) == sorted(ref_grads)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    diffs = {k: (got[k] - want[k]).abs().max().item() for k in want}
    out["param_max_diff"] = max(diffs.values())
    out["param_max_diff_at"] = max(diffs, key=diffs.get)
    out["same_names"] = sorted(got) == sorted(want)
    return out
