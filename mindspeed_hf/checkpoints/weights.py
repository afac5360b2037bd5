"""The weights of `mindspeed_hf.export`, streamed from a sharded checkpoint to safetensors one output file at a time.

The model is built on the meta device (no memory); its state dict says which tensors the HF directory holds, under
which names, and where each is read in the checkpoint (a tied weight is written once, as save_pretrained does).
The output files are planned from the meta shapes (huggingface_hub's split, `max_shard_size`), then each file is
written in turn: its tensors read from the DCP shards (DCP reads only the requested items), cast, for `merge_lora`
folded with their LoRA adapters by PEFT's own `merge` of that layer, renamed to the format the model is loaded
from by transformers' `revert_weight_conversion` (>= 5: fused MoE experts back to one tensor per expert), written
and released. Peak memory: one output file plus the tensor being read (and the adapters, which are small).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["WeightPlan", "plan_weights", "write_weights"]

#: `save_pretrained`'s file names
WEIGHTS = "model{suffix}.safetensors"
INDEX = "model.safetensors.index.json"
_OUR_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


@dataclass
class WeightPlan:
    """What one export writes: the model whose format it is (PEFT merged: the base model, adapters unloaded), and
    per name of its state dict the checkpoint key holding the tensor and the LoRA layer merged into it (if any)."""

    model: nn.Module
    sources: dict[str, str]
    merges: dict[str, Any]


def plan_weights(model: nn.Module, merge_lora: bool) -> WeightPlan:
    """The plan for `model` built on meta (a PeftModel when the run trained an adapter). `merge_lora` unloads the
    adapters (PEFT's `unload`, which keeps every base module as it is) and remembers which LoRA layer wraps each base
    weight, to merge it once the weight is read."""
    checkpoint_key = {id(t): name for name, t in model.state_dict(keep_vars=True).items()}
    lora_of: dict[int, Any] = {}
    if merge_lora:
        from peft.tuners.lora import LoraLayer

        lora_of = {id(m.get_base_layer()): m for m in model.modules() if isinstance(m, LoraLayer)}
        model = model.unload()
    sources: dict[str, str] = {}
    merges: dict[str, Any] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # a tied weight: stored once, under its first name (save_pretrained's choice)
            continue
        seen.add(id(tensor))
        sources[name] = checkpoint_key[id(tensor)]
        owner = model.get_submodule(name.rpartition(".")[0])
        if id(owner) in lora_of and name.endswith(".weight"):
            merges[name] = lora_of[id(owner)]
    return WeightPlan(model, sources, merges)


def _merged(layer: Any, name: str, weight: torch.Tensor) -> torch.Tensor:
    """`weight` with the LoRA adapters of `layer` folded in by PEFT's own merge; the layer's base weight is back on
    meta afterwards (its memory freed when the file is written)."""
    base = layer.get_base_layer()
    attr = name.rpartition(".")[2]
    setattr(base, attr, nn.Parameter(weight, requires_grad=False))
    layer.merge()
    merged = getattr(base, attr).detach()
    setattr(base, attr, nn.Parameter(torch.empty_like(merged, device="meta"), requires_grad=False))
    return merged


def _to_hf_format(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The names and layout from_pretrained reads (transformers >= 5 converts some weights when loading, e.g. MoE
    experts fused into one tensor, and save_pretrained reverts that); unchanged on 4.x, which converts nothing."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return tensors
    return revert_weight_conversion(model, tensors)


def write_weights(plan: WeightPlan, read: Callable[[list[str]], dict[str, torch.Tensor]], out: str,
                  shapes: dict[str, tuple[torch.Size, torch.dtype]], dtype: torch.dtype | None,
                  max_shard_size: str | int) -> torch.dtype:
    """Write the plan's tensors to `out` as save_pretrained would (model*.safetensors, the index when more than one
    file), one file at a time; `read(keys)` gives checkpoint tensors, `shapes` their stored shape and dtype. Returns
    the dtype written (the config records it)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    def written_dtype(name: str) -> torch.dtype:
        stored = shapes[plan.sources[name]][1]
        return dtype if dtype is not None and stored.is_floating_point else stored

    meta = {name: torch.empty(shapes[key][0], dtype=written_dtype(name), device="meta")
            for name, key in plan.sources.items()}
    split = split_torch_state_dict_into_shards(meta, filename_pattern=WEIGHTS, max_shard_size=max_shard_size)
    for stale in os.listdir(out):  # an earlier export's files that this one would not replace
        if _OUR_FILES.fullmatch(stale) and stale not in split.filename_to_tensors:
            os.remove(os.path.join(out, stale))
    weight_map: dict[str, str] = {}
    for filename, names in split.filename_to_tensors.items():
        read_tensors = read([plan.sources[name] for name in names])
        tensors = {}
        for name in names:
            tensor = read_tensors.pop(plan.sources[name])
            if name in plan.merges:
                tensor = _merged(plan.merges[name], name, tensor)
            tensors[name] = tensor.to(written_dtype(name)).contiguous()
        tensors = _to_hf_format(plan.model, tensors)
        save_file(tensors, os.path.join(out, filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, filename))
        del tensors, read_tensors
    if split.is_sharded:
        total = sum(p.numel() for p in plan.model.parameters())  # save_pretrained's num_parameters(): unique ones
        index = {"metadata": {"total_parameters": total, **split.metadata},
                 "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(out, INDEX), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    floating = [t.dtype for t in meta.values() if t.dtype.is_floating_point]
    return floating[0] if floating else torch.float32
