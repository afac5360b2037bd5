"""Tiny configs of every supported family, and the batches the parity tests feed them."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from mindspeed_hf.compat import rope_config

VOCAB = 128
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

FAMILY_CONFIGS: dict[str, dict] = {
    "llama": {},
    "mistral": dict(sliding_window=None),
    "qwen2": {},
    "qwen3": dict(head_dim=16),
    "qwen2_moe": dict(**_MOE, shared_expert_intermediate_size=48, output_router_logits=True),
    "qwen3_moe": dict(**_MOE, head_dim=16),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32, pad_token_id=0, eos_token_id=1),
    # one dense layer then a MoE one (sigmoid group-limited router, shared expert), MLA attention
    "deepseek_v3": dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, head_dim=8, num_key_value_heads=4,
    ),
    "glm4_moe": dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, head_dim=16, use_qk_norm=True,
    ),
    "gpt_oss": dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0, eos_token_id=1, bos_token_id=1,
        **rope_config(),
    ),
    "ernie4_5_moe": dict(
        moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1, moe_layer_start_index=1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ),
    "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16, sliding_window=8),
    "gemma3_text": dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(
        pad_token_id=0, eos_token_id=1, bos_token_id=1,
        **rope_config(theta=10000.0, partial_rotary_factor=0.5),
    ),
}


def tiny_config(model_type: str, **overrides):
    kwargs = {**_COMMON, **FAMILY_CONFIGS[model_type], **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
    return model.float()


def padded_batch(batch: int = 3, seq: int = 19, left: bool = False, seed: int = 1) -> dict[str, torch.Tensor]:
    """Uneven lengths padded right (or left); labels -100 on pads."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (batch, seq), generator=gen)
    mask = torch.zeros(batch, seq, dtype=torch.long)
    for row, length in enumerate(range(seq, seq - 4 * batch, -4)):
        if left:
            mask[row, seq - length:] = 1
        else:
            mask[row, :length] = 1
    labels = input_ids.masked_fill(mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def packed_batch(lengths=(5, 7, 3, 6), seed: int = 2) -> dict[str, torch.Tensor]:
    """Several sequences in one row, told apart by position_ids restarting at 0 (no attention mask)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    input_ids = torch.randint(1, VOCAB, (1, total), generator=gen)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = input_ids.clone()
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    labels[0, starts] = -100  # the first token of each sequence is not predicted from the previous one
    # use_cache=False: with a cache, HF's sdpa does not detect packing and attends across sequences.
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels, "use_cache": False}


def loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_close_grads(expected: dict, actual: dict, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    assert expected.keys() == actual.keys(), set(expected) ^ set(actual)
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")
