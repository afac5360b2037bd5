"""One causal-LM forward for every supported family, with the fused (chunked) linear cross-entropy.

HF's `XForCausalLM.forward` projects every position through `lm_head` before `loss_function` runs, so the
[tokens, vocab] logits (and their gradient) always exist. This replacement runs the backbone exactly as HF does
and, while training with labels, hands the hidden states and the lm_head MODULE to
`ops.fused_linear_cross_entropy`, which never holds more than one [chunk, vocab] block.

Family specifics are read at runtime, so there is one function and no per-family copies:
- MoE (Mixtral, Qwen2-MoE, Qwen3-MoE): recognised by `num_experts_per_tok` / `router_aux_loss_coef` on the model
  and `load_balancing_loss_func` in the model's own modeling module; `output_router_logits` defaults to the
  config, the aux loss is added as HF does, and a `MoeCausalLMOutputWithPast` comes back.
- Gemma2 / Gemma3 text: `config.final_logit_softcapping` (applied in the logits dtype, like HF).
- Everything else (Llama, Mistral, Qwen2, Qwen3, Gemma, Phi3) is the plain shape.

With labels the loss is always the fused one (where the model's loss is HF's `ForCausalLMLoss`), and the logits are
built only if something reads them (kernels.skip_logits, `logits_plan`): under `auto`, the default, they are skipped
while Trainer's own loss computation runs (scope.logits_unread: not with return_outputs, a compute_loss_func or a
prompt-learning PEFT model) and made on first read everywhere else (patches/lazy_logits.py: HF's tensor, from the
kept hidden states through the real lm_head); under `always` skipped in every training forward with labels; under
`never` built by HF's path with HF's loss. Where they are skipped, `outputs.logits` is a SkippedLogits that names the
setting when used. A caller's explicit `skip_logits=True` skips them in eval too (Trainer passes it with
`use_liger_kernel`), `skip_logits=False` takes HF's path. A model whose `loss_function` is not HF's
`ForCausalLMLoss` (custom `loss_type` or `model.loss_function = ...`) keeps the full-logits path, since the fused op
only implements that loss; so does a forward whose lm_head is sharded or gathered around the forward itself
(tensor-parallel DTensors, DeepSpeed ZeRO-3) or traced by torch.compile, where it could not be called again later
(DDP and FSDP2 keep the head's weights as they were until the backward: deferred there too).
`**kwargs` is kept, so Trainer still sees a model that accepts loss kwargs and passes `num_items_in_batch`.

TRL's SFTTrainer wraps `model.forward` on the instance (`trl.trainer.utils.add_fused_lm_head`): its
`fused_lm_head=True` path calls the backbone and its own chunked head directly (this forward is not involved,
so TRL's loss is unchanged), and its other path calls the forward it captured: this one when the class was
patched before TRL wrapped the instance, HF's otherwise. Both keep working (tests/models/test_fused_loss_models).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable

import torch
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.utils import can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg

from ..ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from ..releases import compat
from . import lazy_logits, scope


class SkippedLogitsError(RuntimeError, AttributeError):
    """Using a SkippedLogits. Also an AttributeError, so that `hasattr(outputs.logits, "dtype")` is False: accelerate's
    mixed-precision output conversion (`convert_to_fp32`, every bf16/fp16 Trainer run) probes the outputs that way
    and leaves anything without a dtype alone."""


class SkippedLogits:
    """What stands in `outputs.logits` when the fused loss did not compute them: any use of it raises an error that
    names the setting to change (instead of an AttributeError on None far from the cause)."""

    def __init__(self, mode: str) -> None:
        self._message = (f"mindspeed_hf computed the loss without the [tokens, vocab] logits (kernels.skip_logits="
                         f"{mode}), so this forward returned none; to read outputs.logits with labels while "
                         "training, set kernels.skip_logits to auto (skip only where nothing reads them) or never "
                         "(MINDSPEED_HF_KERNELS_SKIP_LOGITS, --mindspeed_skip_logits), or pass skip_logits=False")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise SkippedLogitsError(self._message)

    def __getitem__(self, item):
        raise RuntimeError(self._message)

    def __iter__(self):
        raise RuntimeError(self._message)

    def __len__(self) -> int:
        raise RuntimeError(self._message)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        placeholder = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, cls))
        raise RuntimeError(placeholder._message)

    def __repr__(self) -> str:
        return "SkippedLogits(not computed: see mindspeed_hf kernels.skip_logits)"


def logits_plan(model: torch.nn.Module, lm_head: torch.nn.Module, labels: torch.Tensor | None,
                skip_logits: bool | None, mode: str) -> str:
    """What a forward does with the logits: "full" (HF's path: logits, then the model's loss), "skip" (the fused loss,
    no logits) or "defer" (the fused loss, logits made on first read: lazy_logits). An explicit `skip_logits`
    argument decides, except under `never`; otherwise `always` skips every training forward with labels, `auto`
    those inside a window where nothing can read the logits (scope.logits_unread: Trainer's own loss computation),
    and any other forward with labels defers them where the lm_head allows it."""
    if labels is None or mode == "never" or not _uses_hf_causal_loss(model):
        return "full"
    if skip_logits is not None:
        return "skip" if skip_logits else "full"
    if model.training and (mode == "always" or scope.logits_unread()):
        return "skip"
    return "defer" if lazy_logits.can_defer(lm_head) else "full"


def tuple_requested(signature: inspect.Signature, arguments: dict, config) -> bool:
    """Whether a head's caller asked for HF's tuple output, however the release takes the switch: a named
    `return_dict` (4.57), `return_dict` in **kwargs (5.x: `can_return_tuple` pops it), or none given and
    `config.return_dict` False. The bound call (`arguments`, HF's forward bound by name) is set up to return a
    ModelOutput, which the head turns into HF's tuple (`ModelOutput.to_tuple()`) when this is True."""
    named = "return_dict" in signature.parameters
    holder = arguments if named else arguments.get("kwargs", {})
    value = holder.get("return_dict")
    if value is None:
        value = getattr(config, "return_dict", True)
    if value is False:  # passed explicitly: overrides a False config.return_dict too
        (arguments if named else arguments.setdefault("kwargs", {}))["return_dict"] = True
    return value is False


def rebuilt(outputs, **fields):
    """`outputs` (a ModelOutput) with `fields` replaced, its keys in HF's order: the replaced fields first, then the
    order HF's own object had (transformers 4.57's capture decorator adds the hidden states after the output is
    built, so its `to_tuple()` is not the dataclass order). Rebuilt, not assigned: a ModelOutput keeps a None field
    out of its dict, so an assigned `loss` would come last."""
    values = {field.name: getattr(outputs, field.name) for field in dataclasses.fields(outputs)}
    result = type(outputs)(**{**values, **fields})
    for key in [*fields, *outputs.keys()]:
        if key in result:
            result.move_to_end(key)
    return result


def _load_balancing_loss_func(model: torch.nn.Module):
    """The family's own `load_balancing_loss_func`, looked up in the modeling module of the model's class
    (or of the first base class that has one, for user subclasses)."""
    for cls in type(model).__mro__:
        fn = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
        if fn is not None:
            return fn
    return None


def _is_moe(model: torch.nn.Module) -> bool:
    return hasattr(model, "num_experts_per_tok") and hasattr(model, "router_aux_loss_coef")


def _uses_hf_causal_loss(model: torch.nn.Module) -> bool:
    """True when the model's loss is HF's ForCausalLMLoss, the one the fused op reproduces."""
    loss_fn = model.loss_function
    return getattr(loss_fn, "__func__", loss_fn) is ForCausalLMLoss


def _softcap(config) -> float | None:
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def _softcapped(softcap: float | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Gemma2/3's final logit softcapping, in the logits dtype exactly as their forwards do it (None: no cap)."""
    if softcap is None:
        return None

    def cap(logits: torch.Tensor) -> torch.Tensor:
        return torch.tanh(logits / softcap) * softcap

    return cap


def _forward(
    self,
    input_ids: torch.LongTensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.LongTensor | None,
    cache,
    inputs_embeds: torch.Tensor | None,
    labels: torch.LongTensor | None,
    use_cache: bool | None,
    logits_to_keep: int | torch.Tensor,
    skip_logits: bool | None,
    kwargs: dict,
    model_only: dict,
) -> CausalLMOutputWithPast | MoeCausalLMOutputWithPast:
    """The body of `causal_lm_forward` for either release's signature. `cache` is the KV cache (`cache` in 5.x,
    `past_key_values` in 4.57); `model_only` holds what the backbone takes but the loss must not see (4.57's
    `cache_position`)."""
    config = self.config
    moe = _is_moe(self)
    model_kwargs = {**kwargs, **model_only}
    output_router_logits = False
    if moe:
        output_router_logits = kwargs.get("output_router_logits")
        if output_router_logits is None:
            output_router_logits = getattr(config, "output_router_logits", False)
        model_kwargs["output_router_logits"] = output_router_logits

    outputs = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **{compat.CACHE_NAME: cache},
        **compat.accepted_kwargs(self.model, model_kwargs),
    )
    hidden_states = compat.slice_to_keep(outputs.last_hidden_state, logits_to_keep)
    lm_head = getattr(self, "lm_head", None)
    if lm_head is None:
        lm_head = self.get_output_embeddings()
    softcap = _softcap(config)

    kernels = scope.current().kernels
    plan = logits_plan(self, lm_head, labels, skip_logits, kernels.skip_logits)
    # HF's MoE forwards take output_router_logits as a named argument, so it never reaches their loss
    loss_kwargs = {k: v for k, v in kwargs.items() if not (moe and k == "output_router_logits")}

    loss = None
    if plan != "full":
        loss = fused_linear_cross_entropy(
            hidden_states,
            lm_head,
            labels,
            shift_labels=loss_kwargs.get("shift_labels"),
            ignore_index=loss_kwargs.get("ignore_index", -100),
            num_items_in_batch=loss_kwargs.get("num_items_in_batch"),
            softcap=softcap,
            chunk_size=kernels.loss_chunk_size,
        )
        logits = (SkippedLogits(kernels.skip_logits) if plan == "skip" else
                  lazy_logits.deferred_logits(lm_head, hidden_states, _softcapped(softcap)))
    else:
        logits = lm_head(hidden_states)
        if softcap is not None:
            logits = _softcapped(softcap)(logits)
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=config.vocab_size, **loss_kwargs)

    if not moe:
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            **{compat.CACHE_NAME: compat.cache_of(outputs)},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    aux_loss = None
    if output_router_logits:
        aux_loss = _load_balancing_loss_func(self)(
            outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask
        )
        if labels is not None:
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    return MoeCausalLMOutputWithPast(
        loss=loss,
        aux_loss=aux_loss,
        logits=logits,
        **{compat.CACHE_NAME: compat.cache_of(outputs)},
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        router_logits=outputs.router_logits,
    )


_DOC = """Drop-in `XForCausalLM.forward` (llama, mistral, qwen2, qwen3, qwen2_moe, qwen3_moe, mixtral, gemma, gemma2,
gemma3 text, phi3): the same arguments and outputs as the installed release's HF forward, plus `skip_logits`.

With labels the loss is computed by the chunked fused linear cross-entropy and `logits` is made on first read
(lazy_logits), or is a SkippedLogits where nothing can read it (kernels.skip_logits, see `logits_plan`); where the
lm_head cannot be called again after the forward (distributed, compiling) or the model's loss is not HF's, the
logits are built and the loss is HF's own.
"""

if compat.CACHE_NAME == "cache":  # transformers >= 5: `cache`, with `past_key_values` as the deprecated alias

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def causal_lm_forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        skip_logits: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | MoeCausalLMOutputWithPast:
        return _forward(self, input_ids, attention_mask, position_ids, cache, inputs_embeds, labels, use_cache,
                        logits_to_keep, skip_logits, kwargs, {})

else:  # transformers 4.57: `past_key_values`, and `cache_position` for the backbone

    @can_return_tuple
    def causal_lm_forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        cache_position: torch.LongTensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        skip_logits: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | MoeCausalLMOutputWithPast:
        model_only = {} if cache_position is None else {"cache_position": cache_position}
        return _forward(self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels,
                        use_cache, logits_to_keep, skip_logits, kwargs, model_only)


causal_lm_forward.__doc__ = _DOC


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def laid_out_as(original: Callable) -> Callable:
    """`causal_lm_forward` taking positional arguments where `original` (the class's HF forward, whose signature the
    patched forward publishes) has them: Mixtral's eighth argument is `output_router_logits`, Llama's is
    `logits_to_keep`, so each positional argument is passed on by the original's name for it."""
    names = [p.name for p in inspect.signature(original).parameters.values() if p.kind in _POSITIONAL][1:]

    def forward(self, *args, **kwargs):
        if len(args) > len(names):
            raise TypeError(f"forward() takes {len(names)} positional arguments after self, got {len(args)}")
        # an argument given both ways: Python's own "got multiple values for keyword argument" TypeError
        return causal_lm_forward(self, **dict(zip(names, args)), **kwargs)

    return forward
