"""Tiny Omni talkers from configs (no downloads) and the training batches their tests feed them.

- Qwen2.5-Omni's talker (`Qwen2_5OmniTalkerForConditionalGeneration`): a Qwen2 decoder with M-RoPE under
  `thinker_to_talker_proj` (thinker width -> talker width) and one `codec_head`.
- Qwen3-Omni's talker (`Qwen3OmniMoeTalkerForConditionalGeneration`): a MoE decoder (shared expert, interleaved
  M-RoPE) whose `codec_head` predicts codebook 0, and a code predictor with one head per further codebook.

A batch is laid out as HF's `Qwen2_5OmniForConditionalGeneration.generate` lays out the talker's prompt, for every
position at once (teacher forcing): the thinker's states (hidden + token embedding) of the prompt, then the reply's
states, each plus the embedding of the codec id at that position (mask on the prompt, pad, bos, the codes, eos).
"""

from __future__ import annotations

import torch
from tiny_vlms import _mrope

THINKER_WIDTH = 48  # the thinker's hidden size: the talker's input width (`embedding_size`)
CODEC_VOCAB = 96
CODEC_PAD, CODEC_BOS, CODEC_EOS, CODEC_MASK = 92, 93, 94, 95  # the Qwen2.5-Omni talker's special codec ids
GROUPS = 4  # Qwen3-Omni: codebooks per frame (codebook 0: the talker; 1 .. 3: the code predictor)
TALKER_TYPES = ("qwen2_5_omni_talker", "qwen3_omni_moe_talker")


def tiny_talker(model_type: str = "qwen2_5_omni_talker", seed: int = 0, vocab: int = CODEC_VOCAB, **overrides):
    """A talker, fp32: 2 decoder layers (64 wide, 4 heads of 16, M-RoPE sections 2/3/3), codec vocabulary `vocab`;
    Qwen3-Omni: 4 experts (2 per token) and a shared expert in every layer; its code predictor: 2 layers, 2 heads of
    32."""
    import transformers

    decoder = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    if model_type == "qwen3_omni_moe_talker":
        text = {**decoder, **_mrope(interleaved=True), "vocab_size": vocab, "num_experts": 4,
                "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                "decoder_sparse_step": 1}
        predictor = dict(vocab_size=CODEC_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_code_groups=GROUPS,
                         max_position_embeddings=64)
        config = transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe.Qwen3OmniMoeTalkerConfig(
            text_config=text, code_predictor_config=predictor, num_code_groups=GROUPS,
            thinker_hidden_size=THINKER_WIDTH, codec_pad_id=CODEC_PAD, codec_bos_id=CODEC_BOS,
            codec_eos_token_id=CODEC_EOS, **{"spatial_merge_size": 2, **overrides})
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as modeling

        model = modeling.Qwen3OmniMoeTalkerForConditionalGeneration(config).float()
        # HF's _init_weights leaves the talker's experts uninitialised (torch.empty) and its routers at zero
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".mlp.experts." in name or name.endswith(".mlp.gate.weight"):
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
        return model
    config = transformers.Qwen2_5OmniTalkerConfig(
        **decoder, **_mrope(), vocab_size=vocab, embedding_size=THINKER_WIDTH, tts_codec_pad_token_id=CODEC_PAD,
        tts_codec_start_token_id=CODEC_BOS, tts_codec_end_token_id=CODEC_EOS, tts_codec_mask_token_id=CODEC_MASK,
        tts_text_start_token_id=1, tts_text_end_token_id=2, tts_text_pad_token_id=0, audio_token_index=3,
        image_token_index=4, video_token_index=5, vision_start_token_id=6, vision_end_token_id=7,
        audio_start_token_id=8, audio_end_token_id=9, **overrides)
    return transformers.Qwen2_5OmniTalkerForConditionalGeneration(config).float()


def codec_sequence(prompt: int, codes: torch.Tensor) -> torch.Tensor:
    """The talker's codec ids for one row: mask on the `prompt` positions, pad, bos, the codes, eos (the layout of
    HF's generate, which feeds mask x prompt, pad, bos and then each generated code)."""
    head = torch.tensor([CODEC_MASK] * prompt + [CODEC_PAD, CODEC_BOS])
    return torch.cat([head, codes, torch.tensor([CODEC_EOS])])


def talker_batch(model, seed: int = 1, prompts=(5, 3), frames=(9, 6), left: bool = False) -> dict[str, torch.Tensor]:
    """Two rows of different lengths, padded right (or left): `inputs_embeds` (thinker states + codec embeddings),
    `attention_mask`, `position_ids` ([3, B, S], as HF's get_rope_index gives for text) and `labels` (the codec ids,
    -100 on the prompt, pad and bos: the codes and eos are the targets)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [codec_sequence(p, torch.randint(0, CODEC_PAD, (f,), generator=gen)) for p, f in zip(prompts, frames)]
    length = max(map(len, rows))
    ids = torch.full((len(rows), length), CODEC_PAD)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for row, (prompt, seq) in enumerate(zip(prompts, rows)):
        span = slice(length - len(seq), length) if left else slice(0, len(seq))
        ids[row, span], mask[row, span] = seq, 1
        labels[row, span] = seq.masked_fill(torch.arange(len(seq)) < prompt + 2, -100)
    thinker = torch.randn(len(rows), length, THINKER_WIDTH, generator=gen)
    embeds = thinker + codec_embeddings(model, ids) * (ids != CODEC_MASK)[..., None]
    positions = (mask.cumsum(-1) - 1).clamp(min=0).masked_fill(mask == 0, 1)
    return {"inputs_embeds": embeds.detach(), "attention_mask": mask,
            "position_ids": positions[None].expand(3, -1, -1).clone(), "labels": labels}


def codec_embeddings(model, ids: torch.Tensor) -> torch.Tensor:
    """The talker's own embedding of codec ids (Qwen2.5-Omni: thinker width, added before its projection)."""
    with torch.no_grad():
        return model.get_input_embeddings()(ids)


def qwen3_talker_batch(model, seed: int = 1, lengths=(11, 7), left: bool = False) -> dict[str, torch.Tensor]:
    """Qwen3-Omni talker rows (talker width inputs, as its text/hidden projections produce them), padded right (or
    left): codebook-0 `labels`, -100 on each row's first three positions and on padding."""
    gen = torch.Generator().manual_seed(seed)
    width = model.config.text_config.hidden_size
    length = max(lengths)
    mask = torch.zeros(len(lengths), length, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, slice(length - n, length) if left else slice(0, n)] = 1
    labels = torch.randint(0, CODEC_PAD, (len(lengths), length), generator=gen).masked_fill(mask == 0, -100)
    labels = labels.masked_fill(mask.cumsum(-1) <= 3, -100)
    return {"inputs_embeds": torch.randn(len(lengths), length, width, generator=gen), "attention_mask": mask,
            "labels": labels}


def code_predictor_batch(model, frames: int = 7, seed: int = 2) -> dict[str, torch.Tensor]:
    """Code-predictor rows, one per frame: [talker state, codebook-0 embedding, codebook 1 .. G-2 embeddings]
    (`inputs_embeds`, G positions) and the frame's G codes (`labels`; column 0, the talker's codebook, and one code
    of the last frame set to -100)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, CODEC_PAD, (frames, GROUPS), generator=gen)
    state = torch.randn(frames, 1, model.config.text_config.hidden_size, generator=gen)
    with torch.no_grad():
        tables = model.code_predictor.get_input_embeddings()
        parts = [state, model.get_input_embeddings()(codes[:, :1])]
        parts += [tables[g - 1](codes[:, g:g + 1]) for g in range(1, GROUPS - 1)]
    labels = codes.clone()
    labels[-1, 2] = -100
    return {"inputs_embeds": torch.cat(parts, dim=1), "labels": labels}
