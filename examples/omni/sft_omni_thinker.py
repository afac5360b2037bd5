"""Audio + image + text fine-tuning of an Omni thinker with a plain transformers.Trainer: the one mindspeed_hf line is
the import.

    python examples/omni/sft_omni_thinker.py --max_steps 10                        # accelerated
    MINDSPEED_HF_AUTO=0 python examples/omni/sft_omni_thinker.py --max_steps 10    # the same script, plain HF
    python examples/omni/sft_omni_thinker.py --freeze_audio true                   # train all but the audio tower

The model is a tiny Qwen2.5-Omni thinker (Qwen2_5OmniThinkerForConditionalGeneration) built from a config, the data
the synthetic rows of `mindspeed-hf train --recipe omni` (mindspeed_hf/recipes/omni_data.py): one generated log-mel clip
(a tone whose pitch and length vary) and one generated image per row, a question about either. Rows are built without
a processor: audio placeholder tokens counted by the model's own rule, `input_features` [clips, mel bins, frames]
zero-padded with `feature_attention_mask`, `pixel_values` and `image_grid_thw`, labels -100 on all but the answer. A
real script would load its thinker with from_pretrained and build rows with Qwen2_5OmniProcessor (which returns
the same fields).

Prints {"step", "loss"} JSON lines (or writes them to --losses_file) and {"report": ...}: what was applied.
"""

import mindspeed_hf  # noqa: F401  (the one added line; MINDSPEED_HF_AUTO=0 imports it without patching)

# isort: split
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText, HfArgumentParser, Trainer, TrainingArguments

from mindspeed_hf.recipes.omni import IMAGE_SIZE, tiny_omni_config
from mindspeed_hf.recipes.omni_data import (
    OmniCollator,
    audio_token_rule,
    encode_omni,
    make_omni_examples,
    make_omni_tokenizer,
)
from mindspeed_hf.recipes.vl_data import PatchLayout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/common.py: loss lines and the report
from common import QUICK_DEFAULTS, JsonLines, LossLogger, emit_report  # noqa: E402


@dataclass
class OmniArguments:
    """Script options (HfArgumentParser turns them into flags next to the TrainingArguments ones)."""

    num_examples: int = field(default=256, metadata={"help": "synthetic training rows (one clip, one image each)"})
    freeze_audio: bool = field(default=False, metadata={"help": "keep the audio tower frozen"})
    losses_file: str | None = field(default=None, metadata={"help": "write JSON lines here instead of stdout"})


def main() -> None:
    parser = HfArgumentParser((OmniArguments, TrainingArguments))
    parser.set_defaults(**QUICK_DEFAULTS)
    example, args = parser.parse_args_into_dataclasses()
    tokenizer = make_omni_tokenizer()
    torch.manual_seed(args.seed)
    model = AutoModelForImageTextToText.from_config(tiny_omni_config(tokenizer))
    if example.freeze_audio:
        model.model.audio_tower.requires_grad_(False)
    layout, audio_rule = PatchLayout.of(model.config.vision_config), audio_token_rule(model)
    rows = [encode_omni(r, tokenizer, layout, audio_rule)
            for r in make_omni_examples(example.num_examples, IMAGE_SIZE, args.seed)]
    out = JsonLines(example.losses_file)
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=OmniCollator(tokenizer.pad_token_id),
                      callbacks=[LossLogger(out)])
    trainer.train()
    emit_report(out, trainer.model)


if __name__ == "__main__":
    main()
