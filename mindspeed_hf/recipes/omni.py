"""`mindspeed-hf train --recipe omni`: the embedded audio + vision + text run.

A tiny Qwen2.5-Omni thinker (`Qwen2_5OmniThinkerForConditionalGeneration`: a Whisper-style audio encoder with
windowed attention, the Qwen2.5-VL vision tower and patch merger, an M-RoPE text decoder) built from a config learns
to answer questions about a generated audio clip and a generated image (recipes/omni_data.py: the pitch or the length
of a tone, the colour of a shape). Like the VL recipe (recipes/vl.py, whose run it shares) it
prints held-out loss and exact-match accuracy before and after training and writes a checkpoint (model + tokenizer)
that `AutoModelForImageTextToText.from_pretrained` loads. Any `--<TrainingArguments key> VALUE` overrides the
recipe's training settings.
"""

from __future__ import annotations

from typing import Any

import torch

from .omni_data import (
    AUDIO_END,
    AUDIO_PAD,
    AUDIO_START,
    IMAGE_PAD,
    MEL_BINS,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    OmniCollator,
    audio_token_rule,
    encode_omni,
    make_omni_examples,
    make_omni_tokenizer,
)
from .vl import (
    LOADER,
    RecipeParts,
    check_transformers,
    recipe_run_config,
    run_recipe,
    tiny_text_vision_configs,
)
from .vl import TRAINING as VL_TRAINING
from .vl_data import PatchLayout

MODEL_TYPE = "qwen2_5_omni_thinker"
# The usual text M-RoPE base: no question here is about a position (the VL recipe's base of 10 is there for its
# quadrant question).
TEXT_ROPE_THETA = 10000.0
IMAGE_SIZE = 16  # 4 x 4 patches of 4 px -> 4 image tokens after the 2 x 2 merger: one per quadrant
N_TRAIN, N_EVAL, DATA_SEED = 3000, 160, 4321
# The VL recipe's settings, with fewer steps (each has more tokens) and its own output directory.
TRAINING = {**VL_TRAINING, "output_dir": "./mindspeed_hf_omni_output", "max_steps": 350,
            "per_device_eval_batch_size": 40}


def tiny_omni_config(tokenizer: Any, hidden: int = 96, layers: int = 3, vision_hidden: int = 64,
                     audio_hidden: int = 64) -> Any:
    """A tiny Qwen2.5-Omni thinker config: the VL recipe's text decoder and vision tower
    (`tiny_text_vision_configs`), a 2-layer audio encoder of width `audio_hidden` over MEL_BINS mel bins, attending
    within 16-frame windows (n_window 8); token ids from `tokenizer`."""
    from transformers import AutoConfig

    text, vision = tiny_text_vision_configs(tokenizer, "qwen2_5_vl", None, hidden, layers, vision_hidden,
                                            rope_theta=TEXT_ROPE_THETA)
    audio = {"num_mel_bins": MEL_BINS, "encoder_layers": 2, "encoder_attention_heads": 2,
             "encoder_ffn_dim": 2 * audio_hidden, "d_model": audio_hidden, "output_dim": hidden, "n_window": 8,
             "max_source_positions": 64}
    ids = tokenizer.convert_tokens_to_ids
    return AutoConfig.for_model(MODEL_TYPE, text_config=text, vision_config=vision, audio_config=audio,
                                audio_token_index=ids(AUDIO_PAD), image_token_index=ids(IMAGE_PAD),
                                video_token_index=ids(VIDEO_PAD), audio_start_token_id=ids(AUDIO_START),
                                audio_end_token_id=ids(AUDIO_END), vision_start_token_id=ids(VISION_START),
                                vision_end_token_id=ids(VISION_END))


def omni_training_args(overrides: list[str] | None = None) -> Any:
    """The recipe's TrainingArguments with `--key value` overrides; built (and checked) before any model."""
    import mindspeed_hf

    from .run_config import build_training_args

    check_transformers("omni")
    return build_training_args(recipe_run_config("omni", MODEL_TYPE, TRAINING), overrides or [],
                               mindspeed_hf.is_enabled())


def omni_datasets(model: Any, tokenizer: Any, n_train: int = N_TRAIN, n_eval: int = N_EVAL
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out) encoded rows for `model` (its patch layout and audio length rule); held-out clips and
    images are drawn from their own seed, never seen in training."""
    layout, rule = PatchLayout.of(model.config.vision_config), audio_token_rule(model)

    def encode(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [encode_omni(r, tokenizer, layout, rule) for r in rows]

    return (encode(make_omni_examples(n_train, IMAGE_SIZE, DATA_SEED)),
            encode(make_omni_examples(n_eval, IMAGE_SIZE, DATA_SEED + 1)))


def build_omni() -> RecipeParts:
    """The recipe's model (fp32, initialised from the current seed), tokenizer, rows and collator."""
    from transformers import AutoModelForImageTextToText

    tokenizer = make_omni_tokenizer()
    model = AutoModelForImageTextToText.from_config(tiny_omni_config(tokenizer), dtype=torch.float32)
    train_rows, eval_rows = omni_datasets(model, tokenizer)
    return RecipeParts(model, tokenizer, train_rows, eval_rows, OmniCollator(tokenizer.pad_token_id))


def run_omni_training(args: Any = None, metrics_file: str | None = None, quality_eval: bool = True,
                      callbacks: list[Any] | None = None) -> dict[str, Any]:
    """Run the Omni recipe with `args` (default: omni_training_args()); prints and returns (and optionally writes)
    the same metrics as the text run."""
    return run_recipe("omni", LOADER, args if args is not None else omni_training_args(), build_omni, metrics_file,
                      quality_eval, callbacks)
