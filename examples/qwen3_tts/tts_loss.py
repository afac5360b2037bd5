"""The Qwen3-TTS fine-tuning objective as a module Trainer can drive: talker loss + 0.3 x code-predictor loss.

Alignment (the one difference from the upstream finetuning/sft_12hz.py, whose labels are shifted once by the
script and again by transformers' causal-LM loss):
- talker: the logits at position t are scored against codebook 0 of the frame at t + 1 (`codec_0_labels[:, t+1]`),
  once; the speech frames and the closing codec eos are the targets.
- code predictor: for the frame at position p it sees [talker hidden at p - 1 (the state that predicted the
  frame's codebook 0), embedding of codebook 0, ..., embedding of codebook G-2]; head j (j = 0 .. G-2) is scored
  against codebook j + 1 of that frame, so every codebook 1 .. G-1 has its head and its loss.
The text embeddings go through `talker.text_projection` (text width -> talker width), as inference does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from data import SPEAKER_SLOT
from torch import nn

CODE_PREDICTOR_WEIGHT = 0.3  # upstream's weighting


def talker_loss(logits: torch.Tensor, codec_0_labels: torch.Tensor) -> torch.Tensor:
    """Next-frame cross-entropy: logits (B, S, V) at t against codec_0_labels (B, S) at t + 1 (-100 ignored)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), codec_0_labels[:, 1:].flatten(), ignore_index=-100)


def code_predictor_loss(logits: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
    """Per-codebook cross-entropy: logits (N, G-1, V) of heads 0 .. G-2 against codebooks 1 .. G-1 of frames
    (N, G), averaged over all N x (G-1) targets."""
    return F.cross_entropy(logits.flatten(0, 1).float(), frames[:, 1:].flatten())


def speaker_embeddings(model: nn.Module, ref_mels: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(B, H) speaker embeddings of each row's own (unpadded) reference mel; the encoder is not trained."""
    encoder = model.speaker_encoder
    dtype = next(encoder.parameters()).dtype
    with torch.no_grad():
        return torch.cat([encoder(mel[None, :n].to(dtype)) for mel, n in zip(ref_mels, lengths.tolist())])


def input_embeddings(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, S, H) talker inputs: projected text embeddings + codec-0 embeddings + the speaker embedding in its slot +
    the embeddings of codebooks 1 .. G-1 on the frame positions."""
    talker = model.talker
    text = talker.text_projection(talker.model.text_embedding(batch["input_ids"][..., 0]))
    codec = talker.model.codec_embedding(batch["input_ids"][..., 1])
    embeds = text * batch["text_embedding_mask"][..., None] + codec * batch["codec_embedding_mask"][..., None]
    speaker = speaker_embeddings(model, batch["ref_mels"], batch["ref_mel_lengths"]).to(embeds.dtype)
    slot = torch.zeros_like(batch["attention_mask"], dtype=embeds.dtype)
    slot[:, SPEAKER_SLOT] = 1
    embeds = embeds + slot[..., None] * speaker[:, None, :]
    frames = batch["codec_mask"][..., None].to(embeds.dtype)
    tables = talker.code_predictor.get_input_embeddings()
    for group in range(1, talker.config.num_code_groups):
        embeds = embeds + tables[group - 1](batch["codec_ids"][..., group]) * frames
    return embeds


def code_predictor_logits(talker: nn.Module, hidden: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
    """(N, G-1, V) logits of the code predictor's heads for frames (N, G) given the talker states (N, H)."""
    groups = talker.config.num_code_groups
    tables = talker.code_predictor.get_input_embeddings()
    inputs = [hidden[:, None], talker.get_input_embeddings()(frames[:, :1])]
    inputs += [tables[g - 1](frames[:, g:g + 1]) for g in range(1, groups - 1)]
    return talker.code_predictor.forward_finetune(inputs_embeds=torch.cat(inputs, dim=1)).logits


class Qwen3TTSFinetune(nn.Module):
    """Wraps Qwen3TTSForConditionalGeneration; forward(**batch from data.Collator) returns
    {"loss", "talker_loss", "code_predictor_loss"}."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, codec_ids: torch.Tensor, codec_0_labels: torch.Tensor,
                codec_mask: torch.Tensor, text_embedding_mask: torch.Tensor, codec_embedding_mask: torch.Tensor,
                attention_mask: torch.Tensor, ref_mels: torch.Tensor,
                ref_mel_lengths: torch.Tensor) -> dict[str, torch.Tensor]:
        batch = dict(input_ids=input_ids, codec_ids=codec_ids, codec_mask=codec_mask, ref_mels=ref_mels,
                     text_embedding_mask=text_embedding_mask, codec_embedding_mask=codec_embedding_mask,
                     attention_mask=attention_mask, ref_mel_lengths=ref_mel_lengths)
        talker = self.model.talker
        embeds = input_embeddings(self.model, batch)
        position_ids, _ = talker.get_rope_index(attention_mask)
        hidden = talker.model(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False).last_hidden_state
        main = talker_loss(talker.codec_head(hidden), codec_0_labels)
        # the state at p - 1 predicted the frame at p: pair them
        states = hidden[:, :-1][codec_mask[:, 1:]]
        frames = codec_ids[codec_mask]
        sub = code_predictor_loss(code_predictor_logits(talker, states, frames), frames)
        return {"loss": main + CODE_PREDICTOR_WEIGHT * sub, "talker_loss": main.detach(),
                "code_predictor_loss": sub.detach()}
