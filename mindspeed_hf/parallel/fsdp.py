"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for Hugging Face causal LMs, PEFT-wrapped or not.

Groups, bottom-up (the torchtitan / accelerate layout):

1. each decoder layer (classes named in ``_no_split_modules``), with forward/backward prefetch; a code
   predictor that its model lists there whole (Qwen3-Omni's talker) is split into its decoder layers, so its
   embedding tables stay in the root group: a training script embeds each frame's codebooks with them outside the
   predictor's forward, as generate does;
2. the input embeddings;
3. the tail, final norm + ``lm_head`` as one group with ``reshard_after_forward=False`` so a fused
   loss can read ``lm_head.weight`` after the forward;
4. the root (whatever is left, e.g. rotary buffers' owner, extra heads).

Tied embeddings (``lm_head.weight is embed_tokens.weight``): one parameter may live in one group
only, so embeddings, norm and ``lm_head`` are left to the root group (kept unsharded after forward).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from ..patches import quantized
from ..patches.families import FAMILIES

__all__ = [
    "apply_fsdp",
    "defer_gradient_reduction",
    "find_decoder_layers",
    "get_fsdp_parts",
    "local_state_bytes",
    "reshard_model",
    "unwrap_hf_model",
]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unwrap_hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (``PeftModel -> LoraModel -> XForCausalLM``)."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        try:
            return get_base()
        except Exception:  # pragma: no cover - defensive: odd wrappers
            pass
    return model


def _no_split_class_names(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for module in (model, unwrap_hf_model(model)):
        found = getattr(module, "_no_split_modules", None)
        if found:
            names.update(found)
    # composite models: sub-models declare their own blocks
    for sub in unwrap_hf_model(model).modules():
        found = getattr(sub, "_no_split_modules", None)
        if found:
            names.update(found)
    return names


def _default_units(model: nn.Module) -> set[str]:
    """``_no_split_modules`` with every code predictor of the families (module docstring) replaced by the classes
    of its decoder layers."""
    names = _no_split_class_names(model)
    predictors = {name for family in FAMILIES.values() for name in family.code_predictors} & names
    for module in model.modules():
        if type(module).__name__ in predictors:
            names.update(type(layer).__name__ for layer in module.model.layers)
    return names - predictors


def find_decoder_layers(model: nn.Module, class_names: Iterable[str] | None = None) -> list[nn.Module]:
    """Modules whose class is named in ``class_names`` (default: ``_no_split_modules``, code predictors by their
    layers), outermost matches, in model order. A given name that no module of the model has is an error naming the
    valid ones."""
    names = set(class_names) if class_names is not None else _default_units(model)
    if class_names is not None:
        present = {type(m).__name__ for m in model.modules()}
        if names - present:
            raise ValueError(f"layer classes to wrap {sorted(names - present)} are not in {type(model).__name__}; "
                             f"valid choices include {sorted(_no_split_class_names(model)) or sorted(present)[:8]}")
    if not names:
        return []
    layers: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if type(module).__name__ in names:
            layers.append(module)
            inside.update(id(m) for m in module.modules())
    return layers


def _final_norm(hf_model: nn.Module) -> nn.Module | None:
    base = getattr(hf_model, "base_model", None)
    candidates = [base] if isinstance(base, nn.Module) and base is not hf_model else []
    decoder = getattr(hf_model, "get_decoder", None)
    if callable(decoder):
        try:
            candidates.append(decoder())
        except Exception:
            pass
    for owner in candidates:
        for attr in ("norm", "final_layernorm", "ln_f", "final_layer_norm"):
            mod = getattr(owner, attr, None)
            if isinstance(mod, nn.Module):
                return mod
    return None


def get_fsdp_parts(model: nn.Module, layer_classes: Iterable[str] | None = None) -> dict[str, object]:
    """The pieces :func:`apply_fsdp` groups: ``layers``, ``embed``, ``norm``, ``lm_head``, ``tied``.

    ``layer_classes``: see :func:`find_decoder_layers`."""
    hf = unwrap_hf_model(model)
    embed = hf.get_input_embeddings() if hasattr(hf, "get_input_embeddings") else None
    lm_head = None
    if hasattr(hf, "get_output_embeddings"):
        lm_head = hf.get_output_embeddings()
    tied = bool(
        embed is not None
        and lm_head is not None
        and getattr(embed, "weight", None) is not None
        and embed.weight is getattr(lm_head, "weight", None)
    )
    return {
        "layers": find_decoder_layers(model, layer_classes),
        "embed": embed,
        "norm": _final_norm(hf),
        "lm_head": lm_head,
        "tied": tied,
    }


def _check_devices(model: nn.Module, mesh: DeviceMesh) -> None:
    allowed = {mesh.device_type, "meta", "cpu"}
    bad = {
        name: t.device
        for name, t in list(model.named_parameters()) + list(model.named_buffers())
        if t.device.type not in allowed
    }
    if bad:
        name, dev = next(iter(bad.items()))
        raise ValueError(
            f"apply_fsdp: mesh device type is {mesh.device_type!r} but {name} lives on {dev}; "
            f"valid choices: parameters on {mesh.device_type!r}, 'cpu' (moved by FSDP) or 'meta'"
        )


def _check_dtypes(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> None:
    for label, dt in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dt is not None and dt not in _FLOAT_DTYPES:
            raise ValueError(f"{label}={dt} is not supported; valid choices: {_FLOAT_DTYPES} or None")


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    prefetch: int = 1,
    layer_classes: Iterable[str] | None = None,
    pre_shard: Iterable[tuple[nn.Module, DeviceMesh]] = (),
) -> nn.Module:
    """Shard ``model`` in place with FSDP2 and return it.

    Args:
        model: a transformers model, or a PEFT model wrapping one (frozen base weights are sharded
            too; LoRA weights stay trainable). Parameters may be on ``meta`` (materialise after).
        mesh: 1-D mesh (FSDP, placement ``Shard(0)``) or 2-D ``(replicate, shard)`` mesh (HSDP,
            placements ``(Replicate(), Shard(0))``), e.g. :func:`~mindspeed_hf.parallel.fsdp_mesh`.
        param_dtype: dtype parameters are all-gathered and computed in (bf16/fp16 mixed precision);
            None keeps the stored dtype.
        reduce_dtype: dtype gradients are reduced in (fp32 by default).
        reshard_after_forward: free the gathered layer weights after forward (ZeRO-3) or keep them
            until backward (ZeRO-2-like). The last layer, the tail group and the root always keep
            them (backward needs them first; a fused loss reads ``lm_head.weight``). After a
            forward without backward (evaluation) call :func:`reshard_model`.
        cpu_offload: keep sharded parameters, gradients and optimizer state on the host
            (``CPUOffloadPolicy``); a no-op (with a warning) on a CPU mesh.
        prefetch: how many layers ahead to all-gather in forward and backward (0: FSDP's default).
        layer_classes: class names sharded one group each (accelerate's transformer_layer_cls_to_wrap);
            default: the model's ``_no_split_modules``.
        pre_shard: (module, mesh) pairs sharded first, each on its own mesh with the same policies (expert
            parallelism's experts on ``expert_fsdp``); the groups above then leave their parameters alone.
    """
    if mesh.ndim not in (1, 2):
        raise ValueError(f"apply_fsdp: mesh must be 1-D (FSDP) or 2-D (HSDP), got ndim={mesh.ndim}")
    if prefetch < 0:
        raise ValueError(f"apply_fsdp: prefetch must be >= 0, got {prefetch}")
    _check_dtypes(param_dtype, reduce_dtype)
    quantized.check_fsdp(model, param_dtype)
    _check_devices(model, mesh)
    if isinstance(model, FSDPModule):
        raise ValueError("apply_fsdp: the model is already sharded with fully_shard")

    offload: OffloadPolicy = OffloadPolicy()
    if cpu_offload:
        if mesh.device_type == "cpu":
            warnings.warn("apply_fsdp: cpu_offload has no effect on a CPU mesh", stacklevel=2)
        else:
            offload = CPUOffloadPolicy(pin_memory=True)
    common = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        "offload_policy": offload,
    }

    for module, own_mesh in pre_shard:
        fully_shard(module, reshard_after_forward=reshard_after_forward, **{**common, "mesh": own_mesh})
    parts = get_fsdp_parts(model, layer_classes)
    layers: list[nn.Module] = parts["layers"]  # type: ignore[assignment]
    if not layers:
        warnings.warn(
            f"apply_fsdp: no decoder layers found for {type(model).__name__} (no _no_split_modules); "
            "sharding the whole model as one group",
            stacklevel=2,
        )
    for i, layer in enumerate(layers):
        # the last layer is needed again right at the start of backward
        last = i == len(layers) - 1
        fully_shard(layer, reshard_after_forward=reshard_after_forward and not last, **common)

    embed, norm, lm_head = parts["embed"], parts["norm"], parts["lm_head"]
    if not parts["tied"]:
        if isinstance(embed, nn.Module) and _has_own_params(embed):
            fully_shard(embed, reshard_after_forward=reshard_after_forward, **common)
        tail = [m for m in (norm, lm_head) if isinstance(m, nn.Module) and _has_own_params(m)]
        if tail:
            fully_shard(tail if len(tail) > 1 else tail[0], reshard_after_forward=False, **common)
    # root: tied embeddings/head (and anything left) stay gathered until backward
    fully_shard(model, reshard_after_forward=False, **common)

    if prefetch and len(layers) > 1:
        for i, layer in enumerate(layers):
            ahead = layers[i + 1 : i + 1 + prefetch]
            behind = layers[max(0, i - prefetch) : i][::-1]
            if ahead:
                layer.set_modules_to_forward_prefetch(ahead)
            if behind:
                layer.set_modules_to_backward_prefetch(behind)
    return model


@contextlib.contextmanager
def defer_gradient_reduction(model: nn.Module, hsdp: bool = False) -> Iterator[None]:
    """Inside: backward accumulates gradients without reducing them across ranks (the micro-batches of one step
    but the last). With ``hsdp`` each micro-batch is still reduce-scattered inside its replica group, so gradients
    stay sharded, and only the all-reduce across replicas waits."""
    if hsdp:
        model.set_requires_all_reduce(False)
    else:
        model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def reshard_model(model: nn.Module) -> nn.Module:
    """Free every gathered parameter (back to local shards) and return ``model``.

    Groups kept unsharded after forward (the tail, the root, the last layer) stay gathered after a
    forward without backward (evaluation under ``no_grad``); call this after such a forward to get
    the memory back and DTensor parameters in ``named_parameters()`` again.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return model


def _has_own_params(module: nn.Module) -> bool:
    """True if ``module`` has parameters that no earlier fully_shard call claimed."""
    for p in module.parameters():
        if not _is_dtensor(p):
            return True
    return False


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local_nbytes(t: torch.Tensor) -> int:
    if _is_dtensor(t):
        t = t.to_local()
    return t.numel() * t.element_size()


def local_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (local shards only).

    Keys: ``params``, ``grads``, ``optim``, ``total``. Tied parameters count once.
    """
    params = list({id(p): p for p in model.parameters()}.values())
    out = {
        "params": sum(_local_nbytes(p) for p in params),
        "grads": sum(_local_nbytes(p.grad) for p in params if p.grad is not None),
        "optim": 0,
    }
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    out["optim"] += _local_nbytes(v)
    out["total"] = out["params"] + out["grads"] + out["optim"]
    return out
