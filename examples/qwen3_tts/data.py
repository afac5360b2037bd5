"""Qwen3-TTS training data: the prepared JSONL, the batch layout the talker expects, and a synthetic generator.

One prepared JSONL row per utterance:
    {"text_ids": [int, ...],           # "<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n"
                                       #   tokenized, minus its last 5 tokens (3 role tokens, then the text)
     "audio_codes": [[int] * G, ...],  # T frames x G codebooks from the 12 Hz speech tokenizer
     "ref_mel": [[float] * 128, ...]}  # the reference clip's 128-bin mel (24 kHz), frames x 128

Producing it from {"audio": wav, "text": str, "ref_audio": wav} rows (what `prepare` below does; it downloads the
tokenizer and processor, so it is not run in CI):
    python examples/qwen3_tts/data.py prepare --input raw.jsonl --output train.jsonl \\
        --model Qwen/Qwen3-TTS-12Hz-1.7B-Base --tokenizer Qwen/Qwen3-TTS-Tokenizer-12Hz
A synthetic file of the same shape for a checkpoint's config (tests, benchmarks, smoke runs):
    python examples/qwen3_tts/data.py synthetic --config path/to/checkpoint --output train.jsonl --rows 64
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

ROLE_TOKENS = 3  # "<|im_start|>assistant\n"
PREFIX = 8  # role tokens, 4 x tts_pad / think slots, tts_bos (text) / codec_pad (codec)
SPEAKER_SLOT = 6  # the position whose codec input is the speaker embedding
MEL_BINS = 128


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The rows of a prepared JSONL file, checked for the three fields."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = {"text_ids", "audio_codes", "ref_mel"} - set(row)
            if missing:
                raise ValueError(f"{path}:{number}: missing {sorted(missing)}; a prepared row has text_ids, "
                                 "audio_codes and ref_mel (see examples/qwen3_tts/data.py)")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def write_jsonl(path: str, rows: Iterable[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


@dataclass(frozen=True)
class SpecialIds:
    """The special token ids the layout uses (from Qwen3TTSConfig and its talker config)."""

    tts_pad: int
    tts_bos: int
    tts_eos: int
    codec_pad: int
    codec_bos: int
    codec_eos: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int

    @classmethod
    def from_config(cls, config: Any) -> SpecialIds:
        talker = config.talker_config
        return cls(config.tts_pad_token_id, config.tts_bos_token_id, config.tts_eos_token_id, talker.codec_pad_id,
                   talker.codec_bos_id, talker.codec_eos_token_id, talker.codec_nothink_id,
                   talker.codec_think_bos_id, talker.codec_think_eos_id)


def _layout_row(ids: SpecialIds, text: torch.Tensor, codes: torch.Tensor, out: dict[str, torch.Tensor],
                i: int) -> None:
    """Write one utterance into row i of the batch tensors. With L text ids and T frames the row holds
    8 + L + T positions; frame k sits at position 8 + L - 1 + k, codec eos right after the last frame.

    text channel : role x3 | tts_pad x4 | tts_bos | text[3:] | tts_eos | tts_pad ... (to the end)
    codec channel: 0 x3 | nothink, think_bos, think_eos, (speaker), codec_pad | codec_pad ... | codec_bos |
                   frame codebook 0 ... | codec_eos
    """
    n_text, n_frames = text.numel(), codes.shape[0]
    first, end = PREFIX + n_text - 1, PREFIX + n_text + n_frames
    tokens, codec = out["input_ids"][i, :, 0], out["input_ids"][i, :, 1]
    tokens[:ROLE_TOKENS] = text[:ROLE_TOKENS]
    tokens[ROLE_TOKENS:PREFIX - 1] = ids.tts_pad
    tokens[PREFIX - 1] = ids.tts_bos
    tokens[PREFIX:first - 2] = text[ROLE_TOKENS:]
    tokens[first - 2] = ids.tts_eos
    tokens[first - 1:end] = ids.tts_pad
    codec[ROLE_TOKENS:PREFIX] = torch.tensor([ids.codec_nothink, ids.codec_think_bos, ids.codec_think_eos, 0,
                                              ids.codec_pad])
    codec[PREFIX:first - 1] = ids.codec_pad
    codec[first - 1] = ids.codec_bos
    codec[first:end - 1] = codes[:, 0]
    codec[end - 1] = ids.codec_eos
    out["codec_0_labels"][i, first:end - 1] = codes[:, 0]
    out["codec_0_labels"][i, end - 1] = ids.codec_eos
    out["codec_ids"][i, first:end - 1] = codes
    out["codec_mask"][i, first:end - 1] = True
    out["text_embedding_mask"][i, :end] = True
    out["codec_embedding_mask"][i, ROLE_TOKENS:end] = True
    out["codec_embedding_mask"][i, SPEAKER_SLOT] = False
    out["attention_mask"][i, :end] = 1


class Collator:
    """Batches prepared rows into the talker's two-channel layout (right padding). Returns input_ids (B, S, 2),
    codec_ids (B, S, G), codec_0_labels (B, S; -100 off the frames and codec eos), the masks, ref_mels
    (B, F, 128, zero-padded) and ref_mel_lengths (B,)."""

    def __init__(self, config: Any) -> None:
        self.ids = SpecialIds.from_config(config)
        self.groups = config.talker_config.num_code_groups

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        texts = [torch.as_tensor(r["text_ids"], dtype=torch.long) for r in rows]
        codes = [torch.as_tensor(r["audio_codes"], dtype=torch.long) for r in rows]
        for c in codes:
            if c.dim() != 2 or c.shape[1] != self.groups:
                raise ValueError(f"audio_codes must be frames x {self.groups} codebooks, got {tuple(c.shape)}")
        batch, length = len(rows), max(PREFIX + t.numel() + c.shape[0] for t, c in zip(texts, codes))
        out = {"input_ids": torch.zeros(batch, length, 2, dtype=torch.long),
               "codec_ids": torch.zeros(batch, length, self.groups, dtype=torch.long),
               "codec_0_labels": torch.full((batch, length), -100, dtype=torch.long),
               "codec_mask": torch.zeros(batch, length, dtype=torch.bool),
               "text_embedding_mask": torch.zeros(batch, length, dtype=torch.bool),
               "codec_embedding_mask": torch.zeros(batch, length, dtype=torch.bool),
               "attention_mask": torch.zeros(batch, length, dtype=torch.long)}
        for i, (text, code) in enumerate(zip(texts, codes)):
            _layout_row(self.ids, text, code, out, i)
        mels = [torch.as_tensor(r["ref_mel"], dtype=torch.float32) for r in rows]
        out["ref_mels"] = torch.nn.utils.rnn.pad_sequence(mels, batch_first=True)
        out["ref_mel_lengths"] = torch.tensor([m.shape[0] for m in mels])
        return out


def synthetic_rows(config: Any, rows: int, seed: int = 0, text_len: tuple[int, int] = (6, 12),
                   frames: tuple[int, int] = (8, 16), mel_frames: int = 40) -> list[dict[str, Any]]:
    """Random prepared rows valid for `config`: text ids below the text vocab's special ids, codebook 0 below the
    talker's codec special ids, codebooks 1.. below the code predictor's vocab."""
    rng = random.Random(seed)
    talker = config.talker_config
    text_top = min(config.tts_pad_token_id, config.im_start_token_id, talker.text_vocab_size)
    codec_top = min(talker.codec_pad_id, talker.codec_bos_id, talker.codec_eos_token_id, talker.codec_nothink_id,
                    talker.codec_think_bos_id, talker.codec_think_eos_id, talker.vocab_size)
    cp_vocab = talker.code_predictor_config.vocab_size
    out = []
    for _ in range(rows):
        n_text, n_frames = rng.randint(*text_len), rng.randint(*frames)
        codes = [[rng.randrange(codec_top)] + [rng.randrange(cp_vocab) for _ in range(talker.num_code_groups - 1)]
                 for _ in range(n_frames)]
        out.append({"text_ids": [rng.randrange(text_top) for _ in range(n_text)], "audio_codes": codes,
                    "ref_mel": [[round(rng.gauss(-4.0, 2.0), 4) for _ in range(MEL_BINS)] for _ in range(mel_frames)]})
    return out


def prepare(input_path: str, output_path: str, model: str, tokenizer: str, batch_size: int = 16) -> None:
    """Raw {"audio", "text", "ref_audio"} rows -> prepared rows: 12 Hz codes from the speech tokenizer, text ids
    from the checkpoint's processor, the reference mel with the package's mel_spectrogram (24 kHz audio)."""
    import librosa
    from qwen_tts_loader import import_qwen_tts

    modeling = import_qwen_tts()
    from qwen_tts import Qwen3TTSTokenizer
    from qwen_tts.core.models import Qwen3TTSProcessor

    speech = Qwen3TTSTokenizer.from_pretrained(tokenizer)
    processor = Qwen3TTSProcessor.from_pretrained(model)
    raw = [json.loads(line) for line in open(input_path) if line.strip()]
    prepared = []
    for start in range(0, len(raw), batch_size):
        chunk = raw[start:start + batch_size]
        codes = speech.encode([r["audio"] for r in chunk]).audio_codes
        for row, code in zip(chunk, codes):
            text = f"<|im_start|>assistant\n{row['text']}<|im_end|>\n<|im_start|>assistant\n"
            ids = processor(text=text, return_tensors="pt")["input_ids"].reshape(-1)[:-5]
            wav, rate = librosa.load(row["ref_audio"], sr=None, mono=True)
            if rate != 24000:
                raise ValueError(f"{row['ref_audio']}: {rate} Hz; the speaker encoder takes 24 kHz audio "
                                 "(ffmpeg -i in.wav -ar 24000 out.wav)")
            mel = modeling.mel_spectrogram(torch.from_numpy(wav).unsqueeze(0), n_fft=1024, num_mels=MEL_BINS,
                                           sampling_rate=24000, hop_size=256, win_size=1024, fmin=0, fmax=12000)
            prepared.append({"text_ids": ids.tolist(), "audio_codes": code.cpu().tolist(),
                             "ref_mel": mel[0].transpose(0, 1).tolist()})
    write_jsonl(output_path, prepared)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    syn = sub.add_parser("synthetic", help="random rows valid for a checkpoint's config")
    syn.add_argument("--config", required=True, help="checkpoint directory (its config.json)")
    syn.add_argument("--output", required=True)
    syn.add_argument("--rows", type=int, default=64)
    syn.add_argument("--seed", type=int, default=0)
    prep = sub.add_parser("prepare", help="raw audio/text rows -> prepared rows (downloads the tokenizers)")
    prep.add_argument("--input", required=True)
    prep.add_argument("--output", required=True)
    prep.add_argument("--model", required=True, help="Qwen3-TTS checkpoint (its processor tokenizes the text)")
    prep.add_argument("--tokenizer", default="Qwen/Qwen3-TTS-Tokenizer-12Hz")
    args = parser.parse_args()
    if args.command == "synthetic":
        from qwen_tts_loader import load_config

        config = load_config(args.config)
        write_jsonl(args.output, synthetic_rows(config, args.rows, args.seed))
    else:
        prepare(args.input, args.output, args.model, args.tokenizer)


if __name__ == "__main__":
    main()
