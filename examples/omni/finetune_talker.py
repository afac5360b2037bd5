"""Fine-tune Qwen2.5-Omni's talker (the model that turns the thinker's reply into speech codes) with a plain
transformers.Trainer: the timbre / dialect use case, where the thinker stays frozen and the talker learns which
codes a voice makes for a reply. The one mindspeed_hf line is the import: with it the talker's decoder runs the
fused kernels and the codec loss is the fused chunked cross-entropy over `codec_head` (no [tokens, codec vocabulary]
logits); MINDSPEED_HF_AUTO=0 runs the same script on plain HF.

    python examples/omni/finetune_talker.py --max_steps 30                       # accelerated
    MINDSPEED_HF_AUTO=0 python examples/omni/finetune_talker.py --max_steps 30   # plain HF

Runs on CPU in seconds with a tiny talker and generated data (no download). What a row is, as HF's
`Qwen2_5OmniForConditionalGeneration.generate` lays out the talker's input, here for every position at once:

    position          text stream (thinker width)                  codec id   label
    prompt 0..P-1     thinker hidden[-1] + hidden[0] of the prompt  mask       -100
    P                 thinker embedding of the speaker's text bos   pad        -100
    P+1               reply token 0 (hidden[-1] + hidden[0])        bos        -100
    P+2+k             reply token k+1 (then text eos, then text pad)  code k    code k
    last              text pad                                      eos        eos

`inputs_embeds` = text stream + the talker's own embedding of the codec id (none on the prompt positions, as in
generate), `labels` = the codec ids with -100 where nothing is predicted: HF's causal-LM convention, shifted once
inside the loss, so the state at P+1+k is scored on code k and the last code's state on eos. Positions are
text positions (`attention_mask.cumsum(-1) - 1`); pass `position_ids` yourself for rows with images or audio
(the talker's `get_rope_index(input_text_ids, image_grid_thw, ...)` gives them).

Real data, in place of `synthetic_rows`:
- thinker states: run the thinker (`Qwen2_5OmniThinkerForConditionalGeneration`, frozen, under no_grad) on the
  prompt and the reply text with `output_hidden_states=True`; `hidden_states[0]` are the token embeddings (zero them
  on audio / image / video positions, as generate does) and `hidden_states[-1]` the last layer; their sum per
  position is the text stream above. The speaker's text bos is `model.speaker_map[speaker]["bos_token"]`, the text
  eos / pad are the talker config's `tts_text_end_token_id` / `tts_text_pad_token_id`, embedded by the thinker.
- codec ids: the talker's vocabulary is the codebook `Qwen2_5OmniToken2WavModel` decodes (`code`); encode your
  recordings of the target voice with the speech tokenizer of that codebook (released by Qwen with the model, not
  part of transformers) and keep the talker's specials for the layout (config `tts_codec_mask_token_id`,
  `tts_codec_pad_token_id`, `tts_codec_start_token_id`, `tts_codec_end_token_id`). One code per position: the
  reply text and the codes run side by side, the text stream moving on one reply token per code.
- the talker: `Qwen2_5OmniForConditionalGeneration.from_pretrained(...).talker` (or the talker alone).

`--talker qwen3_omni_moe`: Qwen3-Omni's talker (a MoE decoder) and its code predictor, several codebooks per frame
(4 here; 16 in the released model). Codebook 0 is the talker's, as above: the input at a frame's position is the
text stream through the talker's `text_projection` plus the sum of that frame's codebook embeddings (codebook 0 from
the talker's `codec_embedding`, codebook g >= 1 from the code predictor's table g-1), as HF's generate builds each
step; `labels` are codebook 0, shifted once. The code predictor then learns the other codebooks of each frame from
the talker's last-layer state one position earlier (what generate hands it): its input is
[that state, codebook 0 .. G-2 embeddings], its labels the frame's G codes, head j scored on codebook j+1. The
objective is the talker's codec loss plus the code predictor's, each a sum over its scored codes divided by the
batch's count (Trainer's `num_items_in_batch`; for the predictor times G-1), so any split of the batch over ranks
gives the same gradients. Real codes come from Qwen3-Omni's multi-codebook speech tokenizer (released with the
model, not part of transformers), one G-code frame per position. Its MoE layers take `parallel: {ep: N}`.
"""

import mindspeed_hf  # (the one added line; MINDSPEED_HF_AUTO=0 imports it without patching)

# isort: split
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from transformers import HfArgumentParser, Trainer, TrainingArguments, modeling_rope_utils

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import QUICK_DEFAULTS, JsonLines, LossLogger, emit_report  # noqa: E402

TEXT_VOCAB, THINKER_WIDTH, CODES = 100, 48, 64  # tiny thinker vocabulary / width; speech codes 0 .. 63
PAD, BOS, EOS, MASK = 64, 65, 66, 67  # the talker's special codec ids (the released config: 8292, 8293, 8294, 8296)
TEXT_BOS, TEXT_EOS, TEXT_PAD = 1, 2, 0
GROUPS = 4  # Qwen3-Omni: codebooks per frame (0: the talker's; 1 .. 3: the code predictor's)
TALKERS = ("qwen2_5_omni", "qwen3_omni_moe")


@dataclass
class TalkerArguments:
    talker: str = field(default="qwen2_5_omni", metadata={
        "help": "qwen2_5_omni (one codebook) or qwen3_omni_moe (MoE talker + code predictor)", "choices": TALKERS})
    num_examples: int = field(default=64, metadata={"help": "generated rows"})
    losses_file: str | None = field(default=None, metadata={"help": "write JSON lines here instead of stdout"})


def _rope(interleaved: bool = False) -> dict:
    """M-RoPE sections 2/3/3 as the installed release spells its rope settings."""
    params = {"rope_type": "default", "mrope_section": [2, 3, 3]}
    if interleaved:
        params["mrope_interleaved"] = True
    if hasattr(modeling_rope_utils, "RopeParameters"):
        return {"rope_parameters": {**params, "rope_theta": 1e4}}
    return {"rope_theta": 1e4, "rope_scaling": {**params, "type": "default"}}


def tiny_talker(kind: str, seed: int = 0) -> nn.Module:
    """Qwen2.5-Omni: a talker 64 wide, 2 layers, codec vocabulary 68. Qwen3-Omni: the same decoder with 4 experts
    (2 per token) and a shared expert per layer, and a 2-layer code predictor for codebooks 1 .. 3."""
    torch.manual_seed(seed)
    decoder = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=256, vocab_size=MASK + 1)
    if kind == "qwen2_5_omni":
        from transformers import Qwen2_5OmniTalkerConfig, Qwen2_5OmniTalkerForConditionalGeneration

        config = Qwen2_5OmniTalkerConfig(
            **decoder, **_rope(), intermediate_size=128, embedding_size=THINKER_WIDTH, tts_codec_pad_token_id=PAD,
            tts_codec_start_token_id=BOS, tts_codec_end_token_id=EOS, tts_codec_mask_token_id=MASK,
            tts_text_start_token_id=TEXT_BOS, tts_text_end_token_id=TEXT_EOS, tts_text_pad_token_id=TEXT_PAD,
            audio_token_index=3, image_token_index=4, video_token_index=5, vision_start_token_id=6,
            vision_end_token_id=7, audio_start_token_id=8, audio_end_token_id=9)
        return Qwen2_5OmniTalkerForConditionalGeneration(config)
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe, modeling_qwen3_omni_moe

    text = {**decoder, **_rope(interleaved=True), "intermediate_size": 96, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
    predictor = dict(vocab_size=MASK + 1, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_code_groups=GROUPS)
    config = configuration_qwen3_omni_moe.Qwen3OmniMoeTalkerConfig(
        text_config=text, code_predictor_config=predictor, num_code_groups=GROUPS, thinker_hidden_size=THINKER_WIDTH,
        codec_pad_id=PAD, codec_bos_id=BOS, codec_eos_token_id=EOS, spatial_merge_size=2)
    talker = modeling_qwen3_omni_moe.Qwen3OmniMoeTalkerForConditionalGeneration(config)
    with torch.no_grad():  # HF's init leaves a new talker's experts unset (torch.empty) and its routers at zero
        for name, param in talker.named_parameters():
            if ".mlp.experts." in name or name.endswith(".mlp.gate.weight"):
                param.normal_(0.0, 0.02)
    return talker


def synthetic_rows(n: int, groups: int = 1, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Rows laid out as the module docstring's table: a frozen stand-in thinker (token embeddings + a fixed
    nonlinear 'last layer') gives the text stream; the target voice says a fixed frame of `groups` codes per reply
    token. `codec_ids` [positions, groups]: codebooks 1.. are -1 where the position holds no frame."""
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(TEXT_VOCAB, THINKER_WIDTH, generator=gen) * 0.5
    layer = torch.randn(THINKER_WIDTH, THINKER_WIDTH, generator=gen) / THINKER_WIDTH ** 0.5
    voice = torch.randint(0, CODES, (TEXT_VOCAB,), generator=gen)  # what the target voice says for each token
    residual = torch.randint(0, CODES, (CODES, groups - 1), generator=gen)  # codebooks 1.. of each frame

    def states(tokens: torch.Tensor) -> torch.Tensor:  # thinker hidden[-1] + hidden[0]
        return torch.tanh(embed[tokens] @ layer) + embed[tokens]

    rows = []
    for _ in range(n):
        prompt = torch.randint(10, TEXT_VOCAB, (int(torch.randint(4, 9, (1,), generator=gen)),), generator=gen)
        reply = torch.randint(10, TEXT_VOCAB, (int(torch.randint(6, 13, (1,), generator=gen)),), generator=gen)
        codes = voice[reply]  # code k is said while the text stream holds reply token k (position P+1+k)
        text = torch.cat([states(prompt), embed[[TEXT_BOS]], states(reply),
                          embed[[TEXT_EOS]], embed[[TEXT_PAD]]])
        first = torch.cat([torch.full((len(prompt),), MASK), torch.tensor([PAD, BOS]), codes, torch.tensor([EOS])])
        codec = torch.full((len(first), groups), -1)
        codec[:, 0] = first
        codec[len(prompt) + 2:-1, 1:] = residual[codes]
        labels = first.masked_fill(torch.arange(len(first)) < len(prompt) + 2, -100)
        rows.append({"thinker_states": text[:len(first)], "codec_ids": codec, "labels": labels})
    return rows


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right padding: codec pad (no frame), text pad states of zero, labels -100, attention mask 0; one codebook:
    codec_ids [batch, positions], several: [batch, positions, codebooks]."""
    length, groups = max(len(r["codec_ids"]) for r in rows), rows[0]["codec_ids"].shape[1]
    codec = torch.full((len(rows), length, groups), -1)
    codec[..., 0] = PAD
    batch = {"thinker_states": torch.zeros(len(rows), length, THINKER_WIDTH),
             "labels": torch.full((len(rows), length), -100),
             "attention_mask": torch.zeros(len(rows), length, dtype=torch.long)}
    for i, row in enumerate(rows):
        n = len(row["codec_ids"])
        batch["thinker_states"][i, :n], codec[i, :n] = row["thinker_states"], row["codec_ids"]
        batch["labels"][i, :n], batch["attention_mask"][i, :n] = row["labels"], 1
    batch["codec_ids"] = codec[..., 0] if groups == 1 else codec
    return batch


def _text_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """[3, batch, positions]: text positions on all three M-RoPE axes (rows with no image or audio)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)[None].expand(3, -1, -1)


def _labels_path() -> bool:
    """True where the talker forwards take `labels` for this objective: with mindspeed_hf on. Plain HF's do not:
    Qwen2.5-Omni's talker takes none, Qwen3-Omni's reads a `config.vocab_size` its config lacks (AttributeError)
    and its code predictor scores every position with one head; there the script computes the loss from logits."""
    return mindspeed_hf.is_enabled()


class TalkerFinetune(nn.Module):
    """Qwen2.5-Omni's talker with its inputs built in the forward (the codec embeddings are the talker's own,
    trained): inputs_embeds = thinker states + embedding of each codec id (not on the prompt's mask positions).

    HF's talker forward takes no labels and computes no loss: with mindspeed_hf its forward takes `labels` (the
    fused loss); on plain HF (MINDSPEED_HF_AUTO=0) the same loss is HF's causal-LM loss function on its logits."""

    def __init__(self, talker: nn.Module) -> None:
        super().__init__()
        self.talker = talker

    def forward(self, thinker_states: torch.Tensor, codec_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor | None = None, **loss_kwargs):
        codec = self.talker.get_input_embeddings()(codec_ids) * (codec_ids != MASK)[..., None]
        inputs = dict(inputs_embeds=thinker_states + codec, attention_mask=attention_mask,
                      position_ids=_text_positions(attention_mask))
        if labels is None or _labels_path():
            return self.talker(**inputs, labels=labels, **loss_kwargs)
        logits = self.talker(**inputs).logits  # plain HF: the loss from its logits, shifted once
        loss = self.talker.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1], **loss_kwargs)
        return {"loss": loss, "logits": logits}


class Qwen3TalkerFinetune(TalkerFinetune):
    """Qwen3-Omni's talker and code predictor (module docstring): the codec loss on codebook 0 plus the code
    predictor's on codebooks 1 .. G-1. With mindspeed_hf both forwards take labels (fused losses, each head on its
    own codebook); on plain HF the same objective is computed from HF's logits."""

    def forward(self, thinker_states: torch.Tensor, codec_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor, num_items_in_batch: torch.Tensor | None = None, **_):
        talker, predictor = self.talker, self.talker.code_predictor
        frames = codec_ids[..., 1] >= 0  # positions holding a whole frame
        tables = [talker.get_input_embeddings(), *predictor.get_input_embeddings()]  # codebook g's table
        first = codec_ids[..., 0]
        embeds = talker.text_projection(thinker_states) + tables[0](first) * (first != MASK)[..., None]
        embeds = embeds + sum(tables[g](codec_ids[..., g].clamp(min=0)) for g in range(1, GROUPS)) * frames[..., None]
        inputs = dict(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=_text_positions(attention_mask),
                      output_hidden_states=True)
        fused, count = _labels_path(), {"num_items_in_batch": num_items_in_batch}
        out = talker(**inputs, labels=labels, **count) if fused else talker(**inputs)
        # each frame's codes from the talker's last-layer state one position earlier (what generate hands over)
        state = out.hidden_states[0][-1][:, :-1][frames[:, 1:]]
        codes = codec_ids[:, 1:][frames[:, 1:]]
        predictor_in = torch.cat([state[:, None], *(tables[g](codes[:, g:g + 1]) for g in range(GROUPS - 1))], dim=1)
        divisor = None if num_items_in_batch is None else num_items_in_batch * (GROUPS - 1)
        if fused:
            rest = predictor(inputs_embeds=predictor_in, labels=codes, num_items_in_batch=divisor).loss
            return {"loss": out.loss + rest}
        codec_loss = talker.loss_function(logits=out.logits, labels=labels, vocab_size=out.logits.shape[-1],
                                          **count)
        hidden = predictor.model(inputs_embeds=predictor_in).last_hidden_state
        summed = sum(F.cross_entropy(predictor.lm_head[j](hidden[:, j + 1]), codes[:, j + 1], reduction="sum")
                     for j in range(GROUPS - 1))
        return {"loss": codec_loss + summed / (codes[:, 1:].numel() if divisor is None else divisor)}


def save_talker(trainer: Trainer, talker: nn.Module, output_dir: str) -> None:
    """The talker as a checkpoint `from_pretrained` loads; sharded (FSDP2 under torchrun) its full weights are
    gathered first and rank 0 writes them."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in talker.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(talker, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if trainer.is_world_process_zero():
            talker.save_pretrained(output_dir, state_dict=state)
    elif trainer.is_world_process_zero():
        talker.save_pretrained(output_dir)


def main() -> None:
    parser = HfArgumentParser((TalkerArguments, TrainingArguments))
    parser.set_defaults(**{**QUICK_DEFAULTS, "max_steps": 30, "learning_rate": 3e-3})
    example, args = parser.parse_args_into_dataclasses()
    qwen3 = example.talker == "qwen3_omni_moe"
    model = (Qwen3TalkerFinetune if qwen3 else TalkerFinetune)(tiny_talker(example.talker, args.seed))
    out = JsonLines(example.losses_file)
    rows = synthetic_rows(example.num_examples, groups=GROUPS if qwen3 else 1)
    trainer = Trainer(model=model, args=args, train_dataset=rows,
                      data_collator=collate, callbacks=[LossLogger(out)])
    trainer.train()
    save_talker(trainer, model.talker, args.output_dir)  # loads with the talker class's from_pretrained
    emit_report(out, model.talker)


if __name__ == "__main__":
    main()
