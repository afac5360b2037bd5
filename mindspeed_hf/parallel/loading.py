"""Meta-device construction and per-rank sharded loading of Hugging Face safetensors checkpoints.

The flow (:func:`from_pretrained_sharded`)::

    meta model (no memory)  ->  apply_fsdp (DTensor shards, still meta)  ->  to_empty(device)
      ->  recompute non-persistent buffers (rotary inv_freq)  ->  read each rank's rows from disk

Every rank reads only the rows of dim 0 its ``Shard(0)`` placement owns (``torch.chunk`` semantics:
chunk size ``ceil(n / world)``, trailing ranks may get fewer or no rows), straight from the
safetensors files with ``safe_open(...).get_slice``; no rank ever holds the full model.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .fsdp import apply_fsdp, unwrap_hf_model

try:  # FSDP's placement for a dim a DTensor already shards (expert parallelism's experts)
    from torch.distributed.tensor.placement_types import _StridedShard as _STRIDED
except ImportError:  # pragma: no cover - older torch
    _STRIDED = None

__all__ = [
    "build_meta_model",
    "from_pretrained_sharded",
    "init_nonpersistent_buffers",
    "load_sharded_safetensors",
    "local_shard_slices",
    "materialize_meta_model",
]

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"

#: module names transformers 5 renames when it loads a checkpoint, as (in the model, in the checkpoint): Mixtral's
#: MoE block (its conversion_mapping)
CHECKPOINT_RENAMES: tuple[tuple[str, str], ...] = ((".mlp.", ".block_sparse_moe."),)
#: transformers 5's fused experts tensors ([E, ...]) and the per-expert weights its save_pretrained writes for them
#: (`<module>.experts.<e>.<weight>`; expert e's slice is its weights concatenated on dim 0, as its conversion_mapping
#: does): Qwen-MoE naming, then Mixtral's.
PER_EXPERT_KEYS: dict[str, tuple[tuple[str, ...], ...]] = {
    "experts.gate_up_proj": (("gate_proj.weight", "up_proj.weight"), ("w1.weight", "w3.weight")),
    "experts.down_proj": (("down_proj.weight",), ("w2.weight",)),
}


def build_meta_model(
    config: Any,
    *,
    dtype: torch.dtype | None = None,
    model_cls: Any = None,
    **kwargs: Any,
) -> nn.Module:
    """``model_cls.from_config(config)`` on the meta device (default ``AutoModelForCausalLM``)."""
    if model_cls is None:
        from transformers import AutoModelForCausalLM

        model_cls = AutoModelForCausalLM
    if dtype is not None:
        kwargs["dtype"] = dtype
    with torch.device("meta"):
        if hasattr(model_cls, "from_config"):
            model = model_cls.from_config(config, **kwargs)
        else:  # a concrete PreTrainedModel class
            model = model_cls._from_config(config, **kwargs)
    return model


def local_shard_slices(
    global_shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Any]
) -> tuple[slice, ...]:
    """This rank's slice of a tensor of ``global_shape`` under ``placements`` on ``mesh``.

    ``Shard(d)`` chunks dim ``d`` like ``torch.chunk`` (chunk size ``ceil(n / mesh size)``; trailing
    ranks may be short or empty); ``Replicate()`` keeps the whole dim.
    """
    bounds = [[0, int(s)] for s in global_shape]
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("local_shard_slices: this rank is not part of the mesh")
    if any(type(p) is _STRIDED for p in placements):  # FSDP over expert parallelism's Shard(0): one contiguous block
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(global_shape, mesh, placements)
        return tuple(slice(o, o + n) for o, n in zip(offset, shape))
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:
            raise NotImplementedError(
                f"local_shard_slices: placement {placement} is not supported; valid choices: "
                "Shard(d), Replicate()"
            )
        d = placement.dim if placement.dim >= 0 else placement.dim + len(bounds)
        start, end = bounds[d]
        n = mesh.size(mesh_dim)
        chunk = math.ceil((end - start) / n) if end > start else 0
        lo = min(start + coord[mesh_dim] * chunk, end)
        hi = min(lo + chunk, end)
        bounds[d] = [lo, hi]
    return tuple(slice(lo, hi) for lo, hi in bounds)


def _owner_map(model: nn.Module) -> dict[int, nn.Module]:
    """id(module) -> the innermost transformers PreTrainedModel that contains it."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return {}
    owners: dict[int, nn.Module] = {}

    def walk(module: nn.Module, owner: nn.Module | None) -> None:
        if isinstance(module, PreTrainedModel):
            owner = module
        if owner is not None:
            owners[id(module)] = owner
        for child in module.children():
            walk(child, owner)

    walk(model, None)
    return owners


@torch.no_grad()
def _recompute_rotary(module: nn.Module, names: list[str]) -> None:
    """transformers 4.57's rotary modules compute ``inv_freq`` only in ``__init__`` (their ``_init_weights``
    leaves it alone): compute it again the same way, with the module's own ``rope_init_fn``."""
    buffer = module._buffers.get("inv_freq")
    init = getattr(module, "rope_init_fn", None)
    if "inv_freq" not in names or init is None or not torch.isnan(buffer).all():
        return
    inv_freq, _ = init(module.config, buffer.device)
    buffer.copy_(inv_freq.to(buffer.dtype))
    if hasattr(module, "original_inv_freq"):
        module.original_inv_freq = buffer


@torch.no_grad()
def init_nonpersistent_buffers(model: nn.Module) -> list[str]:
    """Recompute buffers that no checkpoint holds (rotary ``inv_freq``...) after meta init.

    Each module owning a non-persistent buffer is re-initialised by its model's ``_init_weights``
    (transformers 5 recomputes rotary buffers there; for 4.57's rotary modules their ``rope_init_fn`` runs
    again). Returns the buffer names handled; warns about any buffer left untouched.
    """
    owners = _owner_map(model)
    done: list[str] = []
    for mod_name, module in model.named_modules():
        names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
        if not names:
            continue
        owner = owners.get(id(module))
        init_fn = getattr(owner, "_init_weights", None)
        for n in names:
            if module._buffers[n].is_floating_point():
                module._buffers[n].fill_(float("nan"))
        if init_fn is not None:
            for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                if hasattr(t, "_is_hf_initialized"):
                    del t._is_hf_initialized
            init_fn(module)
        _recompute_rotary(module, names)
        for n in names:
            full = f"{mod_name}.{n}" if mod_name else n
            buf = module._buffers[n]
            if buf.is_floating_point() and torch.isnan(buf).all():
                warnings.warn(
                    f"init_nonpersistent_buffers: nothing recomputes {full} "
                    f"({type(module).__name__}); it stays uninitialised",
                    stacklevel=2,
                )
            else:
                done.append(full)
    return done


def materialize_meta_model(model: nn.Module, device: torch.device | str) -> nn.Module:
    """``to_empty(device)`` a (possibly sharded) meta model and recompute its non-persistent buffers.

    Parameters and persistent buffers are left uninitialised: load them next.
    """
    model.to_empty(device=device)
    hf = unwrap_hf_model(model)
    if hasattr(hf, "tie_weights") and getattr(hf.config, "tie_word_embeddings", False):
        emb, head = hf.get_input_embeddings(), hf.get_output_embeddings()
        if emb is not None and head is not None and emb.weight is not head.weight:
            raise RuntimeError("materialize_meta_model: to_empty untied the tied embeddings")
    init_nonpersistent_buffers(model)
    return model


def _checkpoint_files(path: str) -> dict[str, str]:
    """tensor name -> safetensors file for an HF model directory (single file or sharded index)."""
    index = os.path.join(path, SAFE_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, SAFE_SINGLE)
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(
        f"no {SAFE_SINGLE} or {SAFE_INDEX} in {path!r} (only safetensors checkpoints are supported)"
    )


def _tied_aliases(model: nn.Module) -> dict[str, list[str]]:
    """name -> other names of the same parameter (tied weights), as state_dict keys."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    aliases: dict[str, list[str]] = {}
    for names in by_id.values():
        for n in names:
            aliases[n] = [m for m in names if m != n]
    hf = unwrap_hf_model(model)
    prefix = _prefix_of(model, hf)
    for target, source in (getattr(hf, "all_tied_weights_keys", None) or {}).items():
        aliases.setdefault(prefix + target, []).append(prefix + source)
        aliases.setdefault(prefix + source, []).append(prefix + target)
    return aliases


def _prefix_of(model: nn.Module, sub: nn.Module) -> str:
    if sub is model:
        return ""
    for name, m in model.named_modules():
        if m is sub:
            return name + "."
    return ""


@torch.no_grad()
def load_sharded_safetensors(
    model: nn.Module, path: str, *, strict: bool = True, window_bytes: int = 16 << 20
) -> list[str]:
    """Fill ``model``'s parameters (each rank its own ``Shard(0)`` rows) and persistent buffers.

    Works for DTensor (FSDP-sharded) and plain tensors alike; values are cast to the parameter
    dtype. Tied weights missing from the checkpoint are read under their partner's name; fused experts tensors
    stored per expert (what transformers 5's save_pretrained and the Hub's MoE checkpoints hold) are read from
    their per-expert keys, each rank reading only its own experts.
    Returns the names that were not found (raises instead when ``strict``). Files are re-opened
    every ``window_bytes`` read so the mapped pages a rank has touched stay bounded.
    """
    from safetensors import safe_open

    files = _checkpoint_files(path)
    aliases = _tied_aliases(model)
    targets: dict[str, torch.Tensor] = dict(model.named_parameters())
    for mod_name, module in model.named_modules():
        for n, buf in module._buffers.items():
            if buf is not None and n not in module._non_persistent_buffers_set:
                targets[f"{mod_name}.{n}" if mod_name else n] = buf
    plan: dict[str, list[tuple[str, str, torch.Tensor]]] = {}
    per_expert: list[tuple[str, list[list[str]], torch.Tensor]] = []
    missing: list[str] = []
    for name, tensor in targets.items():
        key = next((k for k in _checkpoint_names(name, aliases) if k in files), None)
        if key is not None:
            plan.setdefault(files[key], []).append((name, key, tensor))
        elif (keys := _per_expert_keys(name, tensor, files)) is not None:
            per_expert.append((name, keys, tensor))
        else:
            missing.append(name)
    if missing and strict:
        raise KeyError(
            f"load_sharded_safetensors: {len(missing)} tensors missing from {path!r}: "
            f"{missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )
    for file, items in plan.items():
        # Re-open the file every `window_bytes` read: the pages a rank touched stay mapped (and
        # count in its RSS) until the mapping closes, so this bounds the transient to ~a window.
        i = 0
        while i < len(items):
            with safe_open(file, framework="pt", device="cpu") as f:
                budget = 0
                while i < len(items) and budget < window_bytes:
                    budget += _read_one(f, file, *items[i])
                    i += 1
    for name, keys, tensor in per_expert:
        _read_experts(files, name, keys, tensor)
    return missing


def _checkpoint_names(name: str, aliases: dict[str, list[str]]) -> list[str]:
    """The names a model tensor may have in a checkpoint: its own, its tied partners', under CHECKPOINT_RENAMES."""
    names = [name, *aliases.get(name, [])]
    return names + [n.replace(new, old) for n in names for new, old in CHECKPOINT_RENAMES if new in n]


def _per_expert_keys(name: str, tensor: torch.Tensor, files: dict[str, str]) -> list[list[str]] | None:
    """For a fused experts tensor the checkpoint stores per expert (PER_EXPERT_KEYS): each expert's keys, in order;
    None when `name` is not one or the checkpoint lacks one of its experts' keys."""
    fused = next((f for f in PER_EXPERT_KEYS if name.endswith(f)), None)
    if fused is None:
        return None
    for module in _checkpoint_names(name[: -len(fused)], {}):
        for weights in PER_EXPERT_KEYS[fused]:
            keys = [[f"{module}experts.{e}.{w}" for w in weights] for e in range(tensor.shape[0])]
            if all(k in files for each in keys for k in each):
                return keys
    return None


def _read_experts(files: dict[str, str], name: str, keys: list[list[str]], tensor: torch.Tensor) -> None:
    """Fill a fused experts tensor from per-expert keys: this rank's experts only (its Shard / _StridedShard rows of
    dim 0), each expert's weights concatenated on dim 0 as transformers' loader does, cut to this rank's slice of
    the other dims."""
    from safetensors import safe_open

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    slices = (local_shard_slices(tuple(tensor.shape), tensor.device_mesh, tensor.placements)
              if isinstance(tensor, DTensor) else tuple(slice(0, n) for n in tensor.shape))
    rows = []
    for expert in range(*slices[0].indices(tensor.shape[0])):
        parts = []
        for key in keys[expert]:
            with safe_open(files[key], framework="pt", device="cpu") as f:
                parts.append(f.get_tensor(key))
        whole = torch.cat(parts)
        if tuple(whole.shape) != tuple(tensor.shape[1:]):
            raise ValueError(f"load_sharded_safetensors: {name} has experts of shape {tuple(tensor.shape[1:])} in the "
                             f"model but {tuple(whole.shape)} from {keys[expert]}")
        rows.append(whole[slices[1:]])
    if rows:
        local.copy_(torch.stack(rows))


def _read_one(f: Any, file: str, name: str, key: str, tensor: torch.Tensor) -> int:
    """Copy this rank's part of checkpoint tensor ``key`` into ``tensor``; returns bytes read."""
    piece = f.get_slice(key)
    shape = tuple(piece.get_shape())
    if shape != tuple(tensor.shape):
        raise ValueError(
            f"load_sharded_safetensors: {name} has shape {tuple(tensor.shape)} in the model but "
            f"{shape} in {file!r}"
        )
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        slices = local_shard_slices(shape, tensor.device_mesh, tensor.placements)
        rows = piece[slices] if shape else f.get_tensor(key)
        if tuple(rows.shape) != tuple(local.shape):
            raise RuntimeError(
                f"load_sharded_safetensors: {name}: computed shard {tuple(rows.shape)} != local "
                f"shard {tuple(local.shape)} ({tensor.placements})"
            )
    else:
        local, rows = tensor, f.get_tensor(key)
    local.copy_(rows)
    return rows.numel() * rows.element_size()


def from_pretrained_sharded(
    path: str,
    mesh: DeviceMesh,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    config: Any = None,
    model_cls: Any = None,
    fsdp_kwargs: dict[str, Any] | None = None,
    strict: bool = True,
    dims: Any = None,
) -> nn.Module:
    """Build an FSDP2-sharded model from an HF checkpoint directory without a full copy per rank.

    Args:
        path: directory with ``config.json`` and safetensors weights.
        mesh: the FSDP mesh (see :func:`~mindspeed_hf.parallel.fsdp_mesh`).
        device: where the shards live (default: the mesh's device type, current index).
        dtype: parameter dtype (default: the config's dtype, else float32).
        config: a config to use instead of ``path``'s.
        model_cls: ``AutoModelForCausalLM`` by default.
        fsdp_kwargs: keyword arguments for :func:`~mindspeed_hf.parallel.apply_fsdp`.
        dims: the built ParallelDims; with ``ep > 1`` the experts are split over the ``ep`` mesh first (as
            parallelize's ep step does) and each rank reads only its experts' rows.
    """
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
    if dtype is None:
        dtype = getattr(config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    if device is None:
        device = _mesh_device(mesh)
    model = build_meta_model(config, dtype=dtype, model_cls=model_cls)
    fsdp_kwargs = dict(fsdp_kwargs or {})
    if dims is not None and dims.ep_enabled:
        from .expert import apply_expert_parallel, expert_fsdp_groups

        apply_expert_parallel(model, dims.get_mesh("ep"))
        fsdp_kwargs["pre_shard"] = expert_fsdp_groups(model, dims.get_mesh("expert_fsdp"))
    apply_fsdp(model, mesh, **fsdp_kwargs)
    materialize_meta_model(model, device)
    load_sharded_safetensors(model, path, strict=strict)
    model.eval()  # like from_pretrained
    return model


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    dt = mesh.device_type
    if dt == "cpu":
        return torch.device("cpu")
    mod = getattr(torch, dt, None)
    index = mod.current_device() if mod is not None and hasattr(mod, "current_device") else 0
    return torch.device(dt, index)
