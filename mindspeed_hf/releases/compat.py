"""Every difference between the supported transformers releases (4.57 .. newest 5.x), in one place.

Each shim is chosen by feature detection (an attribute, a signature, a dataclass field), never by comparing version
numbers, and its docstring names the releases that need it. Code elsewhere in the package asks this module instead
of probing transformers itself, so that dropping an old release is deleting its branch here.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _torch_module
from transformers import masking_utils, modeling_rope_utils, modeling_utils
from transformers.modeling_outputs import CausalLMOutputWithPast

# ------------------------------------------------------------------------------------------- cache argument name

CACHE_NAME: str = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else (
    "past_key_values")
"""The name of the KV cache in model forwards and their outputs: `cache` from transformers 5 on (which still accepts
`past_key_values` as a deprecated alias), `past_key_values` up to 4.57."""


def cache_of(outputs: Any) -> Any:
    """The KV cache field of a model output, whatever the release calls it (see CACHE_NAME)."""
    return getattr(outputs, CACHE_NAME)


# ------------------------------------------------------------------------------------------------- causal-LM head


_slice_logits_to_keep: Callable | None = getattr(modeling_utils, "slice_logits_to_keep", None)


def slice_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions of `hidden_states` [B, S, H] that the lm_head projects, as the causal-LM forwards select them.

    transformers 5 has `modeling_utils.slice_logits_to_keep` (which also takes 2-D selections); 4.57 slices inline in
    each forward: an int keeps the last `n` positions (0 keeps all), a 1-D tensor indexes the sequence axis.
    """
    if _slice_logits_to_keep is not None:
        return _slice_logits_to_keep(hidden_states, logits_to_keep)
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden_states[:, keep, :]


_NAMED: dict[Callable, frozenset[str] | None] = {}  # _named_parameters' memo, for eager mode


def _signature_names(forward: Callable) -> frozenset[str] | None:
    """The keyword names `forward` accepts, or None when it takes **kwargs, read from its signature."""
    params = inspect.signature(forward).parameters.values()
    return None if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params) else frozenset(p.name for p in params)


def _named_parameters(forward: Callable) -> frozenset[str] | None:
    """The keyword names `forward` accepts, or None when it takes **kwargs (accepts any name). While Dynamo traces,
    the memo is neither read nor filled (the signature is read in the trace): a graph guarded on the memo's
    contents would be rebuilt once the memo changes (an eager forward filling it, between two compiled calls)."""
    if torch.compiler.is_compiling():
        return _signature_names(forward)
    if forward not in _NAMED:
        _NAMED[forward] = _signature_names(forward)
    return _NAMED[forward]


def global_module_hooks() -> bool:
    """Whether any forward hook is registered for every module (`torch.nn.modules.module.
    register_module_forward_hook` / `_pre_hook`): a fused path that skips a module call would skip those too."""
    return bool(_torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks)


def accepted_kwargs(module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The part of `kwargs` that `module.forward` accepts.

    transformers 4.57's Qwen2-MoE decoder (`Qwen2MoeModel.forward`) takes no **kwargs, and its causal-LM forward passes
    loss kwargs (`num_items_in_batch`, ...) to the loss only; every other backbone of 4.57 and all of 5.x take
    **kwargs, and get everything.
    """
    names = _named_parameters(type(module).forward)
    return dict(kwargs) if names is None else {k: v for k, v in kwargs.items() if k in names}


# ----------------------------------------------------------------------------------------------------------- rope


def rope_unsqueeze_dim(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """`unsqueeze_dim` of an `apply_rotary_pos_emb(q, k, cos, sin, ...)` call, from the arguments after `sin`.

    5.x and most 4.57 modules: `(q, k, cos, sin, unsqueeze_dim=1)`. 4.57's Qwen2-MoE keeps the legacy
    `(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)` and passes `position_ids` (unused) positionally.
    """
    if "unsqueeze_dim" in kwargs:
        return int(kwargs["unsqueeze_dim"])
    rest = list(args)
    if rest and not isinstance(rest[0], int):  # the legacy position_ids slot (a tensor or None)
        rest.pop(0)
    return int(rest[0]) if rest else 1


def rope_config(theta: float = 10000.0, partial_rotary_factor: float = 1.0) -> dict[str, Any]:
    """Config keyword arguments for default (unscaled) RoPE with base `theta`, rotating `partial_rotary_factor` of
    each head.

    transformers 5 groups them in `rope_parameters` (its `RopeParameters` dict); 4.57 takes `rope_theta` and
    `partial_rotary_factor` as top-level config arguments (and `rope_scaling` for scaled variants).
    """
    if hasattr(modeling_rope_utils, "RopeParameters"):
        return {"rope_parameters": {"rope_type": "default", "rope_theta": float(theta),
                                    "partial_rotary_factor": float(partial_rotary_factor)}}
    return {"rope_theta": float(theta), "partial_rotary_factor": float(partial_rotary_factor)}


# ---------------------------------------------------------------------------------------------- attention masks

MASK_TAKES_CACHE_POSITION: bool = "cache_position" in inspect.signature(masking_utils.sdpa_mask).parameters
"""How transformers calls an AttentionMaskInterface function (and its own sdpa_mask): 4.57 passes the queries as
`cache_position` (a [q_len] tensor of their positions); 5.x passes `q_length`, `q_offset` and `device`."""


def mask_query_span(kwargs: dict[str, Any], kv_length: int) -> tuple[int, int | None, torch.device | str | None]:
    """(q_length, q_offset, device or None) of an AttentionMaskInterface call, from its keyword arguments.

    q_offset is None when it is not known on the host without a device sync: under 4.57 (`cache_position`) it is
    known only for q_length == kv_length, where it must be 0 (the queries then cover every key).
    """
    cache_position = kwargs.get("cache_position")
    if cache_position is not None:
        q_length = int(cache_position.shape[0])
        return q_length, (0 if q_length == kv_length else None), cache_position.device
    return int(kwargs["q_length"]), kwargs.get("q_offset", 0), kwargs.get("device")


def mask_query_kwargs(q_length: int, q_offset: int, device: torch.device) -> dict[str, Any]:
    """Keyword arguments that describe the queries to transformers' own mask builders (`sdpa_mask`, ...): 4.57's
    `cache_position`, or 5.x's `q_length` / `q_offset` / `device` (see MASK_TAKES_CACHE_POSITION)."""
    if MASK_TAKES_CACHE_POSITION:
        return {"cache_position": torch.arange(q_offset, q_offset + q_length, device=device)}
    return {"q_length": q_length, "q_offset": q_offset, "device": device}


@functools.cache
def unpacked_batches_get_sequence_ids() -> bool:
    """transformers 4.57 hands packed-sequence ids to the mask builders for every batch with position_ids and without
    an attention mask, packed or not (all zeros for an unpacked one); 5.x tells them apart (one host sync) and passes
    none for an unpacked batch. Probed on first use, not at import: the probe's first call costs about 5 MB of resident
    memory (masking_utils' tracing check), which a run that never asks must not pay."""
    return masking_utils.find_packed_sequence_indices(torch.arange(4).unsqueeze(0)) is not None


def _attend_everywhere(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Mask function of full (non-causal) attention: every key is visible."""
    return kv_idx >= 0


bidirectional_mask_function: Callable = getattr(masking_utils, "bidirectional_mask_function", _attend_everywhere)
"""The full-attention mask function: `masking_utils.bidirectional_mask_function` in 5.x; 4.57 has none (its encoder
masks are built elsewhere), so an equivalent one is defined here."""


def create_mask(builder: Callable, config: Any, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None = None) -> Any:
    """Call a `masking_utils.create_*_mask` builder for a prefill without a cache, as the model code does.

    5.24: `(config, inputs_embeds, attention_mask, cache, position_ids)`; 5.x before it names the cache
    `past_key_values`. 4.57: `(config, input_embeds, attention_mask, cache_position, past_key_values, position_ids)`.
    """
    params = inspect.signature(builder).parameters
    if "cache_position" not in params:
        no_cache = {"cache": None} if "cache" in params else {"past_key_values": None}
        return builder(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                       position_ids=position_ids, **no_cache)
    cache_position = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)
    return builder(config=config, input_embeds=inputs_embeds, attention_mask=attention_mask,
                   cache_position=cache_position, past_key_values=None, position_ids=position_ids)


def supports_attention_interface(model: nn.Module | type) -> bool:
    """Whether a model class reaches its attention through `AttentionInterface` (so `attn_implementation="mindspeed"`
    applies to it).

    Every supported family does in 5.x; in 4.57 Qwen2-MoE still picks attention classes from a per-model table
    (`QWEN2MOE_ATTENTION_CLASSES`), which transformers reports through `_supports_attention_backend = False`.
    """
    cls = model if isinstance(model, type) else type(model)
    return bool(getattr(cls, "_supports_attention_backend", False))


def _sdpa_ignores_softcap() -> bool:
    """Probe HF's sdpa attention with a soft-cap that changes the result: True when it returns the uncapped result."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    query = torch.tensor([[[[1.0], [2.0]]]])  # [B=1, N=1, S=2, D=1]: scores 1, 2, 2, 4 before capping
    value = torch.tensor([[[[0.0], [1.0]]]])
    module = nn.Module()
    try:
        capped, _ = sdpa_attention_forward(module, query, query, value, None, is_causal=False, softcap=0.5)
    except ValueError:  # refused (5.x)
        return False
    plain, _ = sdpa_attention_forward(module, query, query, value, None, is_causal=False)
    return torch.equal(capped, plain)


SDPA_IGNORES_SOFTCAP: bool = _sdpa_ignores_softcap()
"""transformers 4.57's `sdpa_attention_forward` silently drops `softcap` (so 4.57's default Gemma2, which is "sdpa",
runs without attention logit soft-capping); 5.x refuses it, and Gemma2 there does not support sdpa at all."""


def sdpa_replaceable(model: nn.Module) -> bool:
    """Whether `attn_implementation="mindspeed"` can take the place of this model's "sdpa" with the same results.

    Not in 4.57 for a model without AttentionInterface (see supports_attention_interface), nor for one with attention
    logit soft-capping (`config.attn_logit_softcapping`, Gemma2/3): there HF's sdpa ignores the cap
    (SDPA_IGNORES_SOFTCAP) while our kernel applies it, as eager attention does. Always, in 5.x.
    """
    softcapped = getattr(model.config, "attn_logit_softcapping", None) is not None
    return supports_attention_interface(model) and not (SDPA_IGNORES_SOFTCAP and softcapped)


# ------------------------------------------------------------------------------------------------------- recompute


def enable_activation_checkpointing(model: nn.Module, checkpoint_kwargs: dict[str, Any]) -> bool:
    """Turn on HF's activation checkpointing with `checkpoint_kwargs` (for torch.utils.checkpoint); False when the
    model has no such switch.

    transformers 5 names it `activation_checkpointing_enable(activation_checkpointing_kwargs=...)`; 4.57 (and 5.x
    through a deprecated alias) `gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`.
    """
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)
    else:
        return False
    return True


@functools.cache
def training_args_checkpointing_names() -> tuple[str, str]:
    """The TrainingArguments fields that switch activation checkpointing on and carry its kwargs.

    transformers 5: `activation_checkpointing` / `activation_checkpointing_kwargs` (the `gradient_*` names are
    deprecated aliases there); 4.57: `gradient_checkpointing` / `gradient_checkpointing_kwargs` only.
    """
    from transformers import TrainingArguments  # heavy: only when asked

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    prefix = "activation" if "activation_checkpointing" in fields else "gradient"
    return f"{prefix}_checkpointing", f"{prefix}_checkpointing_kwargs"


def disable_activation_checkpointing(model: nn.Module) -> None:
    """Turn HF's activation checkpointing off again (no-op for a model without the switch).

    transformers 5 names it `activation_checkpointing_disable()`; 4.57 (and 5.x through a deprecated alias)
    `gradient_checkpointing_disable()`.
    """
    for name in ("activation_checkpointing_disable", "gradient_checkpointing_disable"):
        if hasattr(model, name):
            getattr(model, name)()
            return


# ----------------------------------------------------------------------------------------- MoE experts registry


@dataclasses.dataclass(frozen=True)
class ExpertsRegistry:
    """transformers' experts-implementation registry and what its default (`grouped_mm`) runs."""

    functions: Any  # ALL_EXPERTS_FUNCTIONS (an ExpertsInterface)
    default: Callable  # grouped_mm_experts_forward: what a model runs when nothing was requested
    default_name: str
    default_apply_gate: Callable  # the gate use_experts_implementation installs: act_fn(first half) * second half


_EXPERTS: dict[str, ExpertsRegistry | None] = {}  # experts_registry's one answer (a plain dict: torch.compile reads it)


def experts_registry() -> ExpertsRegistry | None:
    """The fused 3-D experts registry (`transformers.integrations.moe`, transformers >= 5); None on 4.57, whose MoE
    blocks hold one module per expert and have no experts implementation to choose. Found once (enable() asks
    first, so a forward traced by torch.compile only reads the answer)."""
    if "registry" not in _EXPERTS:
        _EXPERTS["registry"] = _find_experts_registry()
    return _EXPERTS["registry"]


def _find_experts_registry() -> ExpertsRegistry | None:
    try:
        from transformers.integrations import moe
    except ImportError:
        return None
    if not hasattr(moe, "ALL_EXPERTS_FUNCTIONS") or not hasattr(modeling_utils.PreTrainedModel,
                                                                 "get_correct_experts_implementation"):
        return None
    if not _registered_experts_accepted(moe.ALL_EXPERTS_FUNCTIONS):
        return None
    return ExpertsRegistry(moe.ALL_EXPERTS_FUNCTIONS, moe.grouped_mm_experts_forward, "grouped_mm",
                           moe._default_apply_gate)


def _registered_experts_accepted(functions: Any) -> bool:
    """Whether a model may choose an experts implementation registered in ALL_EXPERTS_FUNCTIONS.

    transformers 5.0 .. 5.9 validate `experts_implementation` against a fixed list (eager, grouped_mm, batched_mm,
    deepgemm) and refuse any other name; 5.10 and later accept every registered name. Probed with a name registered
    for the call only."""
    import types

    probe = "_mindspeed_probe"
    registered(functions)[probe] = registered(functions).get("grouped_mm")
    try:
        modeling_utils.PreTrainedModel.get_correct_experts_implementation(types.SimpleNamespace(), probe)
    except ValueError:
        return False
    except Exception:  # noqa: BLE001 - past the name check (a dispatch check of another implementation)
        return True
    finally:
        registered(functions).pop(probe, None)
    return True


# --------------------------------------------------------------------------- private names used in several modules
# Each is a seam (releases/seams.py, `accessor`): the name appears here and nowhere else in the package.


def registered(interface: Any) -> dict[str, Callable]:
    """The process-wide mapping of a transformers registry (AttentionInterface, AttentionMaskInterface,
    ALL_EXPERTS_FUNCTIONS: `_global_mapping` of GeneralInterface, every release). Its public `register` adds; there
    is no public way to look one name up without the defaults of an instance, or to remove one."""
    return interface._global_mapping


def unregister(interface: Any, name: str) -> None:
    """Remove `name` from a registry instance: its process-wide mapping and its own (`_local_mapping`, set per
    instance in GeneralInterface.__init__)."""
    registered(interface).pop(name, None)
    interface._local_mapping.pop(name, None)


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a model with `config` runs (`config._attn_implementation`, every release;
    None for an object without one)."""
    return getattr(config, "_attn_implementation", None)


def experts_implementation(config: Any) -> str | None:
    """The experts implementation a MoE model with `config` runs (`config._experts_implementation`, transformers
    >= 5; None on 4.57 and for a model without experts)."""
    return getattr(config, "_experts_implementation", None)


def storage_key(storage: torch.UntypedStorage) -> int:
    """An identity of a tensor storage shared by every tensor over it, as torch's own StorageWeakRef keys it
    (`_cdata`, every torch 2.x; `data_ptr()` is not one: 0 for every empty storage)."""
    return storage._cdata


def current_autograd_node() -> Any:
    """The autograd node the engine is running now (None outside a backward pass), as torch's C extension reports it
    (`torch._C._current_autograd_node`, every torch 2.x)."""
    return torch._C._current_autograd_node()


# ----------------------------------------------------------------------------- decoder layers' checkpointing wrapper

def checkpointing_cell(forward: Callable) -> types.CellType | None:
    """The closure cell holding the forward that transformers' GradientCheckpointingLayer wrapper (>= 5.24: it wraps
    every layer class's `forward` at class creation) calls; None for a forward without that wrapper. Replacing the
    cell's contents keeps the wrapper, and with it gradient checkpointing, in place."""
    code = getattr(forward, "__code__", None)
    if code is None or code.co_name != "forward_with_checkpointing" or "forward" not in code.co_freevars:
        return None
    return forward.__closure__[code.co_freevars.index("forward")]


def layer_forward_slot(layer_cls: type) -> tuple[Any, str]:
    """(owner, name) holding the forward function a decoder-layer class runs: (the class, "forward"), or (>= 5.24) the
    closure cell of what transformers' checkpointing wrappers call, followed through every wrapper (FSDP2's subclass
    of a layer class is wrapped again): replacing it there keeps the wrappers, and with them checkpointing."""
    owner, name, function = layer_cls, "forward", layer_cls.forward
    while (cell := checkpointing_cell(function)) is not None:
        owner, name, function = cell, "cell_contents", cell.cell_contents
    return owner, name


def layer_function(layer_cls: type) -> Callable:
    """The forward function a decoder-layer class runs (at `layer_forward_slot`)."""
    return getattr(*layer_forward_slot(layer_cls))
