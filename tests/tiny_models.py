"""Tiny configs of every supported family, and the batches the parity tests feed them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from mindspeed_hf.releases.compat import rope_config

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


# Hybrid linear-attention families (Gated DeltaNet layers among gated full-attention ones): their packed batches are
# checked against the documents as separate rows (tests/models/test_hybrid.py), not against HF's packed forward.
_LINEAR = dict(
    num_hidden_layers=4, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=256,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
)
HYBRID_CONFIGS: dict[str, dict] = {
    # MoE on every second layer (one linear, one full), dense MLPs on the others; a shared expert
    "qwen3_next": dict(**_LINEAR, **_MOE, decoder_sparse_step=2, shared_expert_intermediate_size=48),
    "qwen3_5_text": dict(_LINEAR),
    "qwen3_5_moe_text": dict(**_LINEAR, **_MOE, shared_expert_intermediate_size=48),
}


def tiny_config(model_type: str, **overrides):
    kwargs = {**_COMMON, **{**FAMILY_CONFIGS, **HYBRID_CONFIGS}[model_type], **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
    return model.float()


def modeling_of(model_type: str):
    """The installed transformers modeling module of a mindspeed_hf family, or None (a release without it)."""
    import importlib

    from mindspeed_hf.patches import FAMILIES

    try:
        return importlib.import_module(FAMILIES[model_type].modeling_module)
    except ImportError:
        return None


def installed(model_types) -> list:
    """`model_types` as pytest params, each skipped on a release without its modeling module."""
    return [pytest.param(t, marks=pytest.mark.skipif(modeling_of(t) is None, reason=f"no {t} in this release"))
            for t in model_types]


def imbalance_per_step(balance_config: dict, steps: int) -> list[float]:
    """skewed_moe_model's expert imbalance (busiest / mean, mean over layers) per training-mode forward on its batch,
    with the aux-free balance `balance_config` asks for stepped after each (the weights unchanged)."""
    from mindspeed_hf.config import config_from_dict
    from mindspeed_hf.moe import AuxFreeBalance, ExpertLoad

    model, ids = skewed_moe_model()
    balance = AuxFreeBalance.attach(model, config_from_dict(balance_config))
    load, out = ExpertLoad(model), []
    for _ in range(steps):
        with torch.no_grad():
            model(input_ids=ids)
        counts = load.counts()
        out.append((counts.max(1).values / counts.mean(1)).mean().item())
        if balance is not None:
            balance.step()
    return out


def skewed_moe_model(seed: int = 4) -> tuple[torch.nn.Module, torch.Tensor]:
    """A training-mode tiny qwen3_moe whose routers give expert 0 most of every token's probability (a shared
    component added to every token's embedding, each router's expert-0 row turned towards the mean of its inputs),
    and the batch it was skewed on: every token of it picks expert 0 (aux-free balancing's test and benchmark)."""
    model = tiny_model("qwen3_moe", seed=seed).train()
    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    ids = torch.randint(2, 120, (16, 12), generator=torch.Generator().manual_seed(0))
    inputs: list[torch.Tensor] = []
    handles = [r.register_forward_pre_hook(lambda m, a: inputs.append(a[0].reshape(-1, a[0].shape[-1])))
               for r in routers]
    with torch.no_grad():
        shared = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(9))
        embed = model.model.embed_tokens.weight
        embed += 0.5 * shared / shared.norm() * embed.norm(dim=1).mean()
        model(input_ids=ids)
        for router, seen in zip(routers, inputs):
            mean = seen.mean(0) / seen.mean(0).norm()
            router.weight[0] += 2.0 * mean / (seen @ mean).mean()
    for handle in handles:
        handle.remove()
    return model, ids


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


# ------------------------------------------------------------------------------------------- Qwen3-TTS (qwen-tts)
TTS_GROUPS = 16  # codebooks per frame (the 12 Hz tokenizer's)


@pytest.fixture(scope="module")
def one_thread():
    """Module-scoped single-threaded torch: Qwen3-TTS's speaker encoder (small Conv1d) runs ~70x slower with 2 threads
    on 2 busy cores. Use it with `pytestmark = pytest.mark.usefixtures("one_thread")` after importing it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def qwen_tts_missing() -> str | None:
    """Why the Qwen3-TTS tests cannot run here (None: they can): qwen-tts needs transformers 4.57."""
    import importlib.util

    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return ("Qwen3-TTS runs on transformers 4.57 only (tested in that environment): qwen-tts 0.1.1 pins 4.57.x and "
                "its transformers-5 forks (qwen-tts-hf, qwen-tts-compat) crash on >= 5.24, whose ModelOutput takes "
                "cache= instead of past_key_values=")
    if importlib.util.find_spec("qwen_tts") is None:
        return ("qwen-tts is not installed: pip install --no-deps qwen-tts==0.1.1 && "
                "pip install einops librosa soundfile")
    return None


def tiny_tts_config(groups: int = TTS_GROUPS, text_hidden_size: int = 48, hidden: int = 64, layers: int = 2):
    """A tiny random Qwen3-TTS config (qwen-tts package); text_hidden_size != hidden_size exercises text_projection.
    Special ids: codec 70-76 (< talker vocab 80), text 120-124 (< text vocab 128); codes < 64 (code-predictor vocab).
    `hidden` (a multiple of 16, the head size) and `layers` scale the talker; the code predictor is half as wide."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "qwen3_tts"))
    from qwen_tts_loader import import_qwen_tts

    modeling = import_qwen_tts()
    talker = dict(
        vocab_size=80, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 16,
        num_key_value_heads=2, head_dim=16, text_hidden_size=text_hidden_size, text_vocab_size=128,
        num_code_groups=groups, rope_scaling={"rope_type": "default", "mrope_section": [4, 2, 2], "interleaved": True},
        codec_pad_id=70, codec_bos_id=71, codec_eos_token_id=72, codec_think_id=73, codec_nothink_id=74,
        codec_think_bos_id=75, codec_think_eos_id=76, pad_token_id=70, spk_id={}, spk_is_dialect={},
        codec_language_id={},
        code_predictor_config=dict(vocab_size=64, hidden_size=hidden // 2, intermediate_size=hidden,
                                   num_hidden_layers=layers, num_attention_heads=hidden // 32, num_key_value_heads=1,
                                   head_dim=16, num_code_groups=groups, pad_token_id=0))
    speaker = dict(enc_dim=hidden, enc_channels=[32, 32, 32, 32, 96], enc_attention_channels=16, enc_res2net_scale=4,
                   enc_se_channels=16)
    config = modeling.Qwen3TTSConfig(talker_config=talker, speaker_encoder_config=speaker, tts_model_type="base",
                                     im_start_token_id=120, im_end_token_id=121, tts_pad_token_id=122,
                                     tts_bos_token_id=123, tts_eos_token_id=124)
    for sub in (config, config.talker_config, config.talker_config.code_predictor_config):
        sub._attn_implementation = "sdpa"
    return config


def tiny_tts_model(seed: int = 0, **overrides):
    """Qwen3TTSForConditionalGeneration from tiny_tts_config, fp32, initialised from `seed`."""
    import sys

    torch.manual_seed(seed)
    config = tiny_tts_config(**overrides)
    return sys.modules["qwen_tts.core.models.modeling_qwen3_tts"].Qwen3TTSForConditionalGeneration(config).float()
