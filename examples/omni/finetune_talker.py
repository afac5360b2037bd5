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
"""

import mindspeed_hf  # noqa: F401  (the one added line; MINDSPEED_HF_AUTO=0 imports it without patching)

# isort: split
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import HfArgumentParser, Trainer, TrainingArguments, modeling_rope_utils

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import QUICK_DEFAULTS, JsonLines, LossLogger, emit_report  # noqa: E402

TEXT_VOCAB, THINKER_WIDTH, CODES = 100, 48, 64  # tiny thinker vocabulary / width; speech codes 0 .. 63
PAD, BOS, EOS, MASK = 64, 65, 66, 67  # the talker's special codec ids (the released config: 8292, 8293, 8294, 8296)
TEXT_BOS, TEXT_EOS, TEXT_PAD = 1, 2, 0


@dataclass
class TalkerArguments:
    num_examples: int = field(default=64, metadata={"help": "generated rows"})
    losses_file: str | None = field(default=None, metadata={"help": "write JSON lines here instead of stdout"})


def tiny_talker(seed: int = 0) -> nn.Module:
    """A Qwen2.5-Omni talker, 64 wide, 2 layers, M-RoPE (sections 2/3/3), codec vocabulary 68."""
    from transformers import Qwen2_5OmniTalkerConfig, Qwen2_5OmniTalkerForConditionalGeneration

    section = [2, 3, 3]
    rope = ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": section}}
            if hasattr(modeling_rope_utils, "RopeParameters") else
            {"rope_theta": 1e4, "rope_scaling": {"type": "default", "mrope_section": section}})
    config = Qwen2_5OmniTalkerConfig(
        vocab_size=MASK + 1, embedding_size=THINKER_WIDTH, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        tts_codec_pad_token_id=PAD, tts_codec_start_token_id=BOS, tts_codec_end_token_id=EOS,
        tts_codec_mask_token_id=MASK, tts_text_start_token_id=TEXT_BOS, tts_text_end_token_id=TEXT_EOS,
        tts_text_pad_token_id=TEXT_PAD, audio_token_index=3, image_token_index=4, video_token_index=5,
        vision_start_token_id=6, vision_end_token_id=7, audio_start_token_id=8, audio_end_token_id=9, **rope)
    torch.manual_seed(seed)
    return Qwen2_5OmniTalkerForConditionalGeneration(config)


def synthetic_rows(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Rows laid out as the module docstring's table: a frozen stand-in thinker (token embeddings + a fixed
    nonlinear 'last layer') gives the text stream; the target voice is a fixed code per reply token."""
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(TEXT_VOCAB, THINKER_WIDTH, generator=gen) * 0.5
    layer = torch.randn(THINKER_WIDTH, THINKER_WIDTH, generator=gen) / THINKER_WIDTH ** 0.5
    voice = torch.randint(0, CODES, (TEXT_VOCAB,), generator=gen)  # what the target voice says for each token

    def states(tokens: torch.Tensor) -> torch.Tensor:  # thinker hidden[-1] + hidden[0]
        return torch.tanh(embed[tokens] @ layer) + embed[tokens]

    rows = []
    for _ in range(n):
        prompt = torch.randint(10, TEXT_VOCAB, (int(torch.randint(4, 9, (1,), generator=gen)),), generator=gen)
        reply = torch.randint(10, TEXT_VOCAB, (int(torch.randint(6, 13, (1,), generator=gen)),), generator=gen)
        codes = voice[reply]  # code k is said while the text stream holds reply token k (position P+1+k)
        text = torch.cat([states(prompt), embed[[TEXT_BOS]], states(reply),
                          embed[[TEXT_EOS]], embed[[TEXT_PAD]]])
        codec = torch.cat([torch.full((len(prompt),), MASK), torch.tensor([PAD, BOS]), codes, torch.tensor([EOS])])
        labels = codec.masked_fill(torch.arange(len(codec)) < len(prompt) + 2, -100)
        rows.append({"thinker_states": text[:len(codec)], "codec_ids": codec, "labels": labels})
    return rows


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right padding: codec pad, text pad states of zero, labels -100, attention mask 0; text positions."""
    length = max(len(r["codec_ids"]) for r in rows)
    batch = {"thinker_states": torch.zeros(len(rows), length, THINKER_WIDTH),
             "codec_ids": torch.full((len(rows), length), PAD), "labels": torch.full((len(rows), length), -100),
             "attention_mask": torch.zeros(len(rows), length, dtype=torch.long)}
    for i, row in enumerate(rows):
        n = len(row["codec_ids"])
        batch["thinker_states"][i, :n], batch["codec_ids"][i, :n] = row["thinker_states"], row["codec_ids"]
        batch["labels"][i, :n], batch["attention_mask"][i, :n] = row["labels"], 1
    return batch


class TalkerFinetune(nn.Module):
    """The talker with its inputs built in the forward (the codec embeddings are the talker's own, trained):
    inputs_embeds = thinker states + embedding of each codec id (not on the prompt's mask positions).

    HF's talker forward takes no labels and computes no loss: with mindspeed_hf its forward takes `labels` (the
    fused loss); on plain HF (MINDSPEED_HF_AUTO=0) the same loss is HF's causal-LM loss function on its logits."""

    def __init__(self, talker: nn.Module) -> None:
        super().__init__()
        self.talker = talker

    def forward(self, thinker_states: torch.Tensor, codec_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor | None = None, **loss_kwargs):
        codec = self.talker.get_input_embeddings()(codec_ids) * (codec_ids != MASK)[..., None]
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        inputs = dict(inputs_embeds=thinker_states + codec, attention_mask=attention_mask,
                      position_ids=positions[None].expand(3, -1, -1))
        if labels is None or "labels" in inspect.signature(type(self.talker).forward).parameters:
            return self.talker(**inputs, labels=labels, **loss_kwargs)
        logits = self.talker(**inputs).logits  # plain HF: the loss from its logits, shifted once
        loss = self.talker.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1], **loss_kwargs)
        return {"loss": loss, "logits": logits}


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
    model = TalkerFinetune(tiny_talker(args.seed))
    out = JsonLines(example.losses_file)
    trainer = Trainer(model=model, args=args, train_dataset=synthetic_rows(example.num_examples),
                      data_collator=collate, callbacks=[LossLogger(out)])
    trainer.train()
    save_talker(trainer, model.talker, args.output_dir)  # loads with Qwen2_5OmniTalkerForConditionalGeneration
    emit_report(out, model.talker)


if __name__ == "__main__":
    main()
