"""`mindspeed-hf train --recipe vl`: the embedded vision-language run.

A tiny Qwen2.5-VL-architecture model (vision tower with windowed and full attention, patch merger, M-RoPE text
decoder) built from a config learns to answer questions about synthetic images (recipes/vl_data.py: the colour or the
quadrant of one coloured shape). It prints held-out loss and exact-match accuracy before and after
training, like the text default run, and writes a checkpoint (model + tokenizer) that
`AutoModelForImageTextToText.from_pretrained` loads. Any `--<TrainingArguments key> VALUE` overrides the recipe's
training settings. Needs transformers >= 5 (its Qwen-VL forward takes `mm_token_type_ids`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..config import MindSpeedConfig
from ..device import detect_device_type
from .data import IGNORE_INDEX
from .run_config import DataSpec, ModelSpec, RunConfig, build_training_args
from .text import ThroughputCallback, _resume_target, collect_result, evaluating, print_summary, write_metrics
from .vl_data import (
    IMAGE_PAD,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    PatchLayout,
    VLCollator,
    encode_vl,
    make_examples,
    make_tokenizer,
    takes_mm_token_types,
)

LOADER = "AutoModelForImageTextToText"
IMAGE_SIZE = 32  # 8 x 8 patches of 4 px -> 16 image tokens after the 2 x 2 merger
N_TRAIN, N_EVAL, DATA_SEED = 3000, 150, 1234
TRAINING = {
    "output_dir": "./mindspeed_hf_vl_output",
    "max_steps": 500,
    "per_device_train_batch_size": 32,
    "per_device_eval_batch_size": 50,
    "learning_rate": 3.0e-3,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 20,
    "weight_decay": 0.0,
    "logging_steps": 50,
    "save_strategy": "no",
    "report_to": "none",
    "seed": 0,
}
TEXT_ROPE_THETA = 10.0  # tiny heads: a low base so that 3-D positions 0..7 rotate visibly apart
VL_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl")
CPU_THREADS = 1  # contended or not, this tiny model trains fastest on one thread


def tiny_text_vision_configs(tokenizer: Any, model_type: str = "qwen2_5_vl", vocab_size: int | None = None,
                             hidden: int = 96, layers: int = 3, vision_hidden: int = 64,
                             rope_theta: float = TEXT_ROPE_THETA) -> tuple[dict, dict]:
    """(text config, vision config) dicts of a tiny Qwen-VL-style model (`model_type` qwen3_vl or qwen2_5_vl; the
    Qwen2.5-Omni thinker takes the qwen2_5_vl ones): `layers` text decoder layers of width `hidden` with M-RoPE
    (interleaved on Qwen3-VL) and special token ids from `tokenizer`; a 2-block vision tower of width
    `vision_hidden` (Qwen2.5-VL: one windowed block, one full; Qwen3-VL: learned position embeddings and one
    deepstack level). `vocab_size` overrides the tokenizer's; `rope_theta` is the text M-RoPE base."""
    if model_type not in VL_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not a recipe VLM; choose one of {', '.join(VL_MODEL_TYPES)}")
    heads = 4
    half = hidden // heads // 2
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    rope = {"rope_type": "default", "rope_theta": rope_theta, "mrope_section": section}
    text = {"vocab_size": vocab_size or len(tokenizer), "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 2,
            "head_dim": hidden // heads, "max_position_embeddings": 512, "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, "rope_parameters": rope}
    vision = {"depth": 2, "hidden_size": vision_hidden, "intermediate_size": 2 * vision_hidden, "num_heads": 2,
              "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": hidden,
              "in_channels": 3}
    if model_type == "qwen2_5_vl":
        vision.update(window_size=16, fullatt_block_indexes=[1], hidden_act="silu")
    else:
        rope["mrope_interleaved"] = True
        vision.update(num_position_embeddings=64, deepstack_visual_indexes=[0], hidden_act="gelu_pytorch_tanh")
    return text, vision


def tiny_vl_config(tokenizer: Any, model_type: str = "qwen2_5_vl", vocab_size: int | None = None, hidden: int = 96,
                   layers: int = 3, vision_hidden: int = 64) -> Any:
    """A tiny Qwen-VL config (`model_type` qwen3_vl or qwen2_5_vl) of `tiny_text_vision_configs`, tied embeddings;
    token ids from `tokenizer`. `vocab_size` overrides the tokenizer's (the benchmark uses a real-sized
    vocabulary)."""
    from transformers import AutoConfig

    text, vision = tiny_text_vision_configs(tokenizer, model_type, vocab_size, hidden, layers, vision_hidden)
    ids = tokenizer.convert_tokens_to_ids
    return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_id=ids(IMAGE_PAD),
                                video_token_id=ids(VIDEO_PAD), vision_start_token_id=ids(VISION_START),
                                vision_end_token_id=ids(VISION_END), tie_word_embeddings=True)


def check_transformers(recipe: str = "vl") -> None:
    """A media recipe's one-line refusal on a transformers before 5 (found by its Qwen-VL forward having no
    `mm_token_type_ids`; the Omni recipe's configs need transformers 5's `rope_parameters` too)."""
    from transformers import Qwen2_5_VLForConditionalGeneration, __version__

    if not takes_mm_token_types(Qwen2_5_VLForConditionalGeneration):
        raise ValueError(f"--recipe {recipe} needs transformers >= 5 (installed: {__version__}; its Qwen-VL forward "
                         "has no mm_token_type_ids); upgrade transformers or run the text recipe")


def recipe_run_config(recipe: str, model_type: str, training: dict[str, Any]) -> RunConfig:
    """An embedded recipe as a RunConfig: its `training` settings and the accelerator's defaults (MINDSPEED_HF_*
    variables and MINDSPEED_HF_CONFIG still apply), so TrainingArguments are built exactly as for the text run."""
    return RunConfig(model=ModelSpec(config={"model_type": model_type}, tokenizer=f"<{recipe} recipe>"),
                     data=DataSpec(), mindspeed=MindSpeedConfig(), training=dict(training), source=f"--recipe {recipe}")


def vl_run_config() -> RunConfig:
    """The VL recipe as a RunConfig (`recipe_run_config`)."""
    return recipe_run_config("vl", "qwen2_5_vl", TRAINING)


def vl_training_args(overrides: list[str] | None = None) -> Any:
    """The recipe's TrainingArguments with `--key value` overrides; built (and checked) before any model."""
    import mindspeed_hf

    check_transformers()
    return build_training_args(vl_run_config(), overrides or [], mindspeed_hf.is_enabled())


@torch.no_grad()
def answer_accuracy(model: torch.nn.Module, collator: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]],
                    rows: list[dict[str, Any]],
                    batch_size: int = 50) -> float:
    """Share of rows whose greedy answer equals the reference answer. Computed in one forward per batch: greedy
    decoding reproduces an answer (and stops at its EOS) exactly when every answer token, EOS included, is the
    arg-max given the reference prefix, so this is the exact match of `generate` without its per-token loop."""
    if not rows:
        return float("nan")
    correct = 0
    with evaluating(model) as device:
        for start in range(0, len(rows), batch_size):
            batch = {k: v.to(device) for k, v in collator(rows[start:start + batch_size]).items()}
            targets = batch.pop("labels")[:, 1:]
            predicted = model(**batch).logits[:, :-1].argmax(-1)
            right = (predicted == targets) | (targets == IGNORE_INDEX)
            correct += int(right.all(dim=1).sum())
    return correct / len(rows)


def _quality(trainer: Any, collator: Callable[..., dict[str, torch.Tensor]], rows: list[dict[str, Any]]
             ) -> dict[str, float]:
    loss = trainer.evaluate()["eval_loss"]
    return {"eval_loss": float(loss), "exact_match": answer_accuracy(trainer.model, collator, rows),
            "num_prompts": len(rows)}


def vl_datasets(tokenizer: Any, layout: PatchLayout, with_mm_token_types: bool, n_train: int = N_TRAIN,
                n_eval: int = N_EVAL) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out) encoded rows; held-out images are drawn from their own seed, never seen in training."""
    def encode(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [encode_vl(r, tokenizer, layout, with_mm_token_types) for r in rows]

    return (encode(make_examples(n_train, IMAGE_SIZE, DATA_SEED)),
            encode(make_examples(n_eval, IMAGE_SIZE, DATA_SEED + 1)))


@dataclass
class RecipeParts:
    """What a recipe builds after the seed is set: the model, its tokenizer, train and held-out rows, the collator."""

    model: torch.nn.Module
    tokenizer: Any
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    collator: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]]


def run_recipe(recipe: str, loader: str, args: Any, build: Callable[[], RecipeParts], metrics_file: str | None = None,
               quality_eval: bool = True, callbacks: list[Any] | None = None) -> dict[str, Any]:
    """Train an embedded media recipe: seed, `build()`, Trainer (MindSpeedTrainer when the accelerator is on),
    held-out loss and exact match before and after, checkpoint (model + tokenizer) in `args.output_dir`; prints
    and returns (and optionally writes) the same metrics as the text run, with `recipe` and `loader` (the
    from_pretrained class that loads the checkpoint)."""
    from transformers import Trainer, set_seed

    import mindspeed_hf

    started = time.perf_counter()
    accelerated = mindspeed_hf.is_enabled()  # as enabled (MINDSPEED_HF_* variables, MINDSPEED_HF_CONFIG)
    set_seed(args.seed)
    parts = build()
    device_type = detect_device_type()
    if device_type == "cpu":
        torch.set_num_threads(CPU_THREADS)
    throughput = ThroughputCallback(device_type)
    trainer_cls = mindspeed_hf.MindSpeedTrainer if accelerated else Trainer
    trainer = trainer_cls(model=parts.model, args=args, train_dataset=parts.train_rows, eval_dataset=parts.eval_rows,
                          data_collator=parts.collator, processing_class=parts.tokenizer,
                          callbacks=[throughput, *(callbacks or [])])
    resume = _resume_target(args.resume_from_checkpoint)
    before = _quality(trainer, parts.collator, parts.eval_rows) if quality_eval and resume is None else None
    output = trainer.train(resume_from_checkpoint=resume)
    after = _quality(trainer, parts.collator, parts.eval_rows) if quality_eval else None
    trainer.save_model(args.output_dir)
    parts.tokenizer.save_pretrained(args.output_dir)
    result = {"recipe": recipe, **collect_result(trainer, output, throughput, started=started, before=before,
                                                 after=after), "loader": loader}
    print_summary(result)
    write_metrics(result, metrics_file)
    return result


def run_vl_training(args: Any = None, metrics_file: str | None = None, quality_eval: bool = True,
                    callbacks: list[Any] | None = None) -> dict[str, Any]:
    """Run the VL recipe with `args` (default: vl_training_args()); prints and returns (and optionally writes)
    the same metrics as the text run."""
    def build() -> RecipeParts:
        from transformers import AutoModelForImageTextToText

        tokenizer = make_tokenizer()
        config = tiny_vl_config(tokenizer)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        train_rows, eval_rows = vl_datasets(tokenizer, PatchLayout.of(config.vision_config),
                                            takes_mm_token_types(model))
        return RecipeParts(model, tokenizer, train_rows, eval_rows, VLCollator(tokenizer.pad_token_id))

    return run_recipe("vl", LOADER, args if args is not None else vl_training_args(), build, metrics_file,
                      quality_eval, callbacks)
