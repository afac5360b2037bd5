"""`mindspeed_hf.export` / `mindspeed-hf export`: a checkpoint the accelerator wrote, as a Hugging Face model directory,
in one CPU process (no torchrun).

A sharded checkpoint (`checkpoint-N/` with `pytorch_model_fsdp_0/`, the DCP shards of any layout: dp_shard, HSDP,
ep, cp, tp) is streamed (checkpoints/weights.py): the model is rebuilt on the meta device from the config the
checkpoint carries (trainers/fsdp.py writes it beside the shards) and its tensors are read back from the shards -
DCP re-assembles each tensor whatever the layout that wrote it - one output file at a time, in save_pretrained's
names, formats and shard sizes. Peak memory: one output file plus the tensor being read. A PEFT run gives the
adapter (PEFT's format), or with `merge_lora` the merged model (PEFT's merge of each layer, as merge_and_unload).
An unsharded directory (Trainer's checkpoint without sharding, or `save_model`'s output) is copied, or, to change
its dtype or merge its adapter, read with `from_pretrained` and written by `save_pretrained` (the whole model in
memory). The processor and tokenizer files Trainer saved beside the weights are copied; README.md and export.json
say where the model came from.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import warnings
from typing import Any

import torch
from torch import nn

from ..parallel.checkpoint import COMPLETE_MARKER
from .layout import MODEL_DIR, OPTIMIZER_DIR, TRAINER_STATE, check_checkpoint, checkpoint_step
from .weights import plan_weights, write_weights

__all__ = ["export"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: what a checkpoint holds besides the model's side files: training state (Trainer's, and accelerate save_state's:
#: random_states_<i>.pkl, scheduler*.bin, sampler*.bin, custom_checkpoint_<i>.pkl, scaler.pt), weights, and what
#: save_pretrained writes
_NOT_COPIED = (COMPLETE_MARKER, "rng_state*.pth", "scheduler.pt", "optimizer.pt", "scaler.pt", TRAINER_STATE,
               "training_args.bin", "*.safetensors", "*.bin", "*.index.json", "config.json", "generation_config.json",
               "adapter_config.json", "README.md", "random_states_*.pkl", "custom_checkpoint_*.pkl")
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.index.json")


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, *, merge_lora: bool = False,
           dtype: str | None = None, max_shard_size: str | int = "5GB", push_to_hub: str | None = None,
           overwrite: bool = False) -> str:
    """Write the model of `checkpoint` to `out` as a Hugging Face directory; returns `out`.

    Args:
        checkpoint: a Trainer checkpoint (`checkpoint-N`, sharded or not) or a `save_model` directory.
        out: the directory to write (created; must not be the checkpoint itself). It must be new or empty unless
            `overwrite`.
        merge_lora: for a PEFT LoRA run, write the merged full model instead of the adapter.
        dtype: `bf16`, `fp16` or `fp32` (default: as saved).
        max_shard_size: the largest safetensors file (`save_pretrained`'s setting): a number with KB, MB, GB or TB
            (`5GB`, `500MB`), or a number of bytes.
        push_to_hub: a Hub repository id (`user/name`): the written directory is uploaded there (the repository
            is created if needed; the token is huggingface_hub's: HF_TOKEN or `hf auth login`).
        overwrite: `out` may hold files: the model files there (weights and their index, configs, adapter,
            tokenizer and processor files, README.md, export.json) are replaced by the exported model's, so the
            directory never mixes two models; other files are kept.

    The export is written into a staging directory beside `out` and moved into place once whole: an export that
    fails or is killed leaves `out` as it was. Raises ValueError (one line naming the file or the setting) for a
    missing, incomplete or truncated checkpoint, a directory that holds no model, `merge_lora` without an adapter, an
    unknown dtype or shard size, an invalid repository id, or a non-empty `out` without `overwrite`, before anything
    is written.
    """
    src, out = os.path.normpath(str(checkpoint)), os.path.normpath(str(out))
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"export: unknown dtype {dtype!r}; valid choices: {', '.join(DTYPES)}")
    max_shard_size = shard_size(max_shard_size)
    if push_to_hub is not None:
        _check_repo_id(push_to_hub)
    if not os.path.isdir(src):
        what = "is a file, not a checkpoint directory" if os.path.exists(src) else "does not exist"
        raise ValueError(f"export: the checkpoint {src} {what}; give a checkpoint-N directory of a run, or "
                         "save_model's output directory")
    if os.path.abspath(src) == os.path.abspath(out):
        raise ValueError(f"export: the output directory {out} is the checkpoint itself; choose another")
    _check_out(out, overwrite)
    sharded = os.path.isdir(os.path.join(src, MODEL_DIR))
    if sharded or os.path.isfile(os.path.join(src, TRAINER_STATE)):  # a Trainer checkpoint: finished and whole?
        src = check_checkpoint(src, sharded=sharded, purpose="export")
    if merge_lora and not _is_peft(src):
        raise ValueError(f"export --merge-lora: {src} holds no LoRA adapter (no adapter_config.json)")
    dtype_ = DTYPES[dtype] if dtype is not None else None
    staging = _staging(out)
    try:
        if sharded:
            _from_shards(src, staging, merge_lora, dtype_, max_shard_size)
        else:
            _from_directory(src, staging, merge_lora, dtype_, max_shard_size)
        _copy_side_files(src, staging)
        _say_where_from(src, staging, merge_lora)
        _publish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if push_to_hub is not None:
        _push(out, push_to_hub, src)
    return out


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]B)", re.IGNORECASE)


def shard_size(value: str | int) -> str | int:
    """`max_shard_size` checked: a number with KB, MB, GB or TB (what both huggingface_hub's and transformers'
    writers read), or a whole number of bytes; else a one-line ValueError naming the option."""
    text = str(value).strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    match = _SIZE.fullmatch(text)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"export: --shard-size (max_shard_size) {value!r} is not a size; valid choices: a number with "
                         "KB, MB, GB or TB (5GB, 500MB), or a number of bytes")
    return f"{match.group(1)}{match.group(2).upper()}"


#: what a Hugging Face model directory holds: with `overwrite`, the earlier model's files that go
_MODEL_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.index.json", "*.gguf", "config.json",
                "generation_config.json", "adapter_config.json", "README.md", "export.json", "tokenizer*", "vocab*",
                "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template*", "*.model",
                "*.tiktoken", "*preprocessor_config.json", "processor_config.json")


def _check_out(out: str, overwrite: bool) -> None:
    """`out` may be written: new, empty, or `overwrite`; refused before anything is written otherwise."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"export: the output {out} is a file; give a directory")
    found = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if found and not overwrite:
        listed = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise ValueError(f"export: the output directory {out} is not empty ({listed}); choose a new or empty "
                         "directory, or --overwrite (overwrite=True) to replace the model there")


def _staging(out: str) -> str:
    """Where the export is written before it is moved into `out`: a hidden sibling (the same file system)."""
    parent, name = os.path.split(os.path.abspath(out))
    staging = os.path.join(parent, f".{name}.exporting")
    shutil.rmtree(staging, ignore_errors=True)  # a killed export's
    os.makedirs(staging)
    return staging


def _publish(staging: str, out: str) -> None:
    """The written export into `out`: renamed into place when `out` is new or empty; else (overwrite) the model
    files `out` held removed first (a sub-directory holding a model or an adapter too), then each file moved in."""
    if not os.path.isdir(out) or not os.listdir(out):
        if os.path.isdir(out):
            os.rmdir(out)
        os.replace(staging, out)
        return
    for name in os.listdir(out):
        path = os.path.join(out, name)
        if os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                       for f in ("config.json", "adapter_config.json")):
            shutil.rmtree(path)
        elif os.path.isfile(path) and any(fnmatch.fnmatch(name, pattern) for pattern in _MODEL_FILES):
            os.remove(path)
    for name in os.listdir(staging):
        target = os.path.join(out, name)
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.replace(os.path.join(staging, name), target)


def _check_repo_id(repo_id: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ValueError(f"export --push-to-hub: {repo_id!r} is not a Hub repository id ("
                         f"{str(e).splitlines()[0]}); valid choices: `name` or `user/name`") from None


def _push(out: str, repo_id: str, src: str) -> None:
    """Upload the written directory to the Hub repository `repo_id` (created when missing), one commit."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, exist_ok=True)
    api.upload_folder(repo_id=repo_id, folder_path=out,
                      commit_message=f"mindspeed-hf export of {os.path.basename(os.path.abspath(src))}")


def _model_class(config: Any) -> type[nn.Module]:
    """The class named by the config's `architectures` (what save_pretrained recorded), from transformers."""
    import transformers

    names = getattr(config, "architectures", None) or []
    for name in names:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    raise ValueError(f"export: config.json names no transformers model class (architectures={names}); valid "
                     "choices: a checkpoint written by a transformers model")


def _is_peft(src: str) -> bool:
    return os.path.isfile(os.path.join(src, "adapter_config.json"))


def _from_shards(src: str, out: str, merge_lora: bool, dtype: torch.dtype | None, max_shard_size: str | int) -> None:
    """A sharded checkpoint: the model rebuilt on the meta device from its config, its tensors read from the DCP
    shards file by file (every shard layout reads back whole in one process); a PEFT run's adapter, small, is read
    whole and written by PEFT's save_pretrained."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(src, "config.json")):
        raise ValueError(f"export: {src} has no config.json (a checkpoint written before mindspeed_hf recorded the "
                         "model's config beside its shards); valid choices: a checkpoint of this release, or "
                         "save_model's output")
    config = AutoConfig.from_pretrained(src)
    quantized = getattr(config, "quantization_config", None)
    if quantized is not None and (merge_lora or not _is_peft(src)):
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else type(quantized).__name__
        raise ValueError(f"export: the base model of {src} is quantized ({method}); valid choices: its LoRA adapter "
                         "(without --merge-lora), merged afterwards onto the full-precision base with PEFT's "
                         "merge_and_unload")
    with torch.device("meta"):
        model = _model_class(config)(config)
    if _is_peft(src):
        from peft import PeftConfig, get_peft_model

        model = get_peft_model(model, PeftConfig.from_pretrained(src))
    shards = os.path.join(src, MODEL_DIR)
    reader = dcp.FileSystemReader(shards)
    stored = {key.removeprefix("model."): (meta.size, meta.properties.dtype)
              for key, meta in reader.read_metadata().state_dict_metadata.items()
              if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}

    def read(keys: list[str]) -> dict[str, torch.Tensor]:
        state = {key: torch.empty(stored[key][0], dtype=stored[key][1]) for key in keys}
        with warnings.catch_warnings():  # DCP warns that it reads in one process: what no_dist asks it to do
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load({"model": state}, storage_reader=reader, no_dist=True)
        return state

    trained = [name for name, param in model.named_parameters() if param.requires_grad] if _is_peft(src) else []
    # a quantized base (QLoRA) is stored packed, with its quantization state: only the adapters are read from it
    expected = set(trained) if quantized else set(model.state_dict())
    missing = sorted(expected - set(stored))
    unexpected = [] if quantized else sorted(set(stored) - expected)
    if missing or unexpected:
        raise ValueError(f"export: the shards in {shards} do not match {type(model).__name__} (missing "
                         f"{missing[:3]}, unexpected {unexpected[:3]}); an unknown layout")
    os.makedirs(out, exist_ok=True)
    if trained:  # the adapters (what the run trained) are small: read whole, into the meta-built model
        model.load_state_dict(read(trained), strict=False, assign=True)
        if not merge_lora:
            (model.to(dtype) if dtype is not None else model).save_pretrained(out)
            return
    plan = plan_weights(model, merge_lora)
    written = write_weights(plan, read, out, stored, dtype, max_shard_size)
    config.dtype = str(written).removeprefix("torch.")  # as save_pretrained records the weights' dtype
    config.architectures = [type(plan.model).__name__]
    config.save_pretrained(out)
    generation = os.path.join(src, "generation_config.json")
    if os.path.isfile(generation):
        shutil.copy2(generation, os.path.join(out, "generation_config.json"))


def _from_directory(src: str, out: str, merge_lora: bool, dtype: torch.dtype | None,
                    max_shard_size: str | int) -> None:
    """An unsharded checkpoint or save_model directory (a model, or a PEFT adapter): its files copied when nothing
    changes; otherwise read with from_pretrained (PEFT: PeftModel on its base model) and written by
    save_pretrained - the whole model in memory."""
    from transformers import AutoConfig

    peft = _is_peft(src)
    weights = [f for f in os.listdir(src) if any(fnmatch.fnmatch(f, p) for p in _WEIGHT_FILES)]
    if not weights or not (peft or os.path.isfile(os.path.join(src, "config.json"))):
        found = ", ".join(sorted(os.listdir(src))[:8]) or "nothing"
        raise ValueError(f"export: {src} holds no model (looked for {MODEL_DIR}/, config.json with model weights, "
                         f"adapter_config.json with adapter weights); found: {found}")
    if dtype is None and not merge_lora:  # already a Hugging Face directory: its files as they are
        os.makedirs(out, exist_ok=True)
        for name in [*weights, "config.json", "generation_config.json", "adapter_config.json"]:
            if os.path.isfile(os.path.join(src, name)):
                shutil.copy2(os.path.join(src, name), os.path.join(out, name))
        return
    if peft:
        from peft import PeftConfig, PeftModel

        base = PeftConfig.from_pretrained(src).base_model_name_or_path
        if not base:
            raise ValueError(f"export: {src}/adapter_config.json names no base model (base_model_name_or_path)")
        model = PeftModel.from_pretrained(_model_class(AutoConfig.from_pretrained(base)).from_pretrained(base), src)
        if merge_lora:
            model = model.merge_and_unload()
    else:
        model = _model_class(AutoConfig.from_pretrained(src)).from_pretrained(src)
    (model.to(dtype) if dtype is not None else model).save_pretrained(out, max_shard_size=max_shard_size)


def _copy_side_files(src: str, out: str) -> None:
    """Tokenizer, processor and chat-template files Trainer saved in the checkpoint (not its training state)."""
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not any(fnmatch.fnmatch(name, p) for p in _NOT_COPIED):
            shutil.copy2(path, os.path.join(out, name))


def _say_where_from(src: str, out: str, merged: bool) -> None:
    """One line in README.md: the checkpoint, its step and its run."""
    step = checkpoint_step(src)
    what = "merged LoRA model" if merged else ("LoRA adapter" if _is_peft(src) else "model")
    line = (f"Exported by `mindspeed-hf export` ({what}) from {os.path.abspath(src)}"
            f"{f' (step {step})' if step is not None else ''}, run {os.path.abspath(os.path.dirname(src))}.\n")
    readme = os.path.join(out, "README.md")
    separator = "\n" if os.path.isfile(readme) and os.path.getsize(readme) else ""  # PEFT writes a model card
    with open(readme, "a") as f:
        f.write(separator + line)
    with open(os.path.join(out, "export.json"), "w") as f:
        json.dump({"checkpoint": os.path.abspath(src), "step": step, "what": what,
                   "sharded": os.path.isdir(os.path.join(src, MODEL_DIR)),
                   "optimizer_state_left": os.path.isdir(os.path.join(src, OPTIMIZER_DIR))}, f, indent=1)
