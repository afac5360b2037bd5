"""The functions that take the place of diffusers' own at each kernel site, and the switch they share.

A site runs our kernel only while an accelerated denoiser runs (`running()`: its forward, or one of its blocks
recomputed in backward) and the current config has the op on; otherwise it runs diffusers' own code. That keeps the
shared sites (torch.nn.RMSNorm, diffusers' RMSNorm, attention_processor.py's F.scaled_dot_product_attention) plain
for everything else (a VAE, a text encoder, an unsupported denoiser).

Attention goes through our kernel only where diffusers would run its default ("native", torch SDPA): an attention
backend chosen explicitly (`set_attention_backend`, the `attention_backend` context manager, DIFFUSERS_ATTN_BACKEND)
is kept, and so is diffusers' own context parallelism (`parallel_config`). Why not register a backend in the
dispatcher: its names are an Enum that `set_attention_backend` validates against (a new one would mean mutating
diffusers' Enum), its `_native_npu` backend reads the mask back to the host on every call (`torch.all(mask != 0)`),
refuses fp32 under DIFFUSERS_ATTN_CHECKS and has no backward under its context parallelism; and
attention_processor.py's processors do not use the dispatcher at all.
"""

from __future__ import annotations

import contextvars
import functools
import sys
import types
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.dit_attention import dit_attention
from ...ops.dit_rms_norm import dit_rms_norm
from ...ops.dit_rope import complex_tables, dit_rope
from ...ops.swiglu import swiglu_packed
from .. import scope
from ..forwards import tag
from .families import DenoiserFamily

#: The family of the accelerated denoiser running now (set by its hooks, model.py), None outside one.
_running: contextvars.ContextVar[DenoiserFamily | None] = contextvars.ContextVar("mindspeed_hf_denoiser", default=None)
_TABLES = 8
_tables: OrderedDict[tuple[int, int], tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()

# diffusers' private names these sites read (diffusers 0.42; tests/models/test_diffusion_seams.py checks them):
# attention_dispatch._AttentionBackendRegistry._active_backend and AttentionBackendName.NATIVE.
DISPATCH = "diffusers.models.attention_dispatch"


def running() -> DenoiserFamily | None:
    return _running.get()


def enter(family: DenoiserFamily) -> contextvars.Token:
    return _running.set(family)


def leave(token: contextvars.Token) -> None:
    _running.reset(token)


def routed(op: str) -> bool:
    """An accelerated denoiser runs and the current config has `op` (a kernels switch) on. While torch.compile
    traces (it cannot trace a ContextVar) the sites run diffusers' code, which the compiler fuses itself."""
    if torch.compiler.is_compiling():
        return False
    return _running.get() is not None and scope.kernel_on(op)


def switch(op: str, fast: Callable, original: Callable) -> Callable:
    """`fast` while routed(op), else `original`; presents the original's name and signature."""

    @functools.wraps(original)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        return (fast if routed(op) else original)(*args, **kwargs)

    return tag(op, dispatch)


def native_default() -> bool:
    """diffusers' active attention backend is its default, native (nothing chosen globally)."""
    dispatch = sys.modules[DISPATCH]
    return dispatch._AttentionBackendRegistry._active_backend == dispatch.AttentionBackendName.NATIVE


# ------------------------------------------------------------------------------------------------------ attention
def dispatch_function(original: Callable) -> Callable:
    """A family module's `dispatch_attention_fn` (q/k/v [B, S, N, D]): ours where diffusers would run native."""

    @functools.wraps(original)
    def dispatch_attention_fn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                              scale: float | None = None, enable_gqa: bool = False,
                              attention_kwargs: dict[str, Any] | None = None, *, backend: Any = None,
                              parallel_config: Any = None) -> torch.Tensor:
        if hasattr(parallel_config, "mindspeed_attention"):  # our context parallelism (parallel/context/denoiser.py)
            return parallel_config.mindspeed_attention(query, key, value, attn_mask, dropout_p, scale, is_causal)
        if (routed("attention") and backend is None and parallel_config is None and not attention_kwargs
                and not enable_gqa and native_default()):
            if attn_mask is not None and attn_mask.dim() == 2 and tuple(attn_mask.shape) == (query.shape[0],
                                                                                            key.shape[1]):
                attn_mask = attn_mask[:, None, None, :]  # [B, Skv] keys, as the native backend reads it
            return dit_attention(query, key, value, "BSND", attn_mask, dropout_p, scale, is_causal)
        return original(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, attention_kwargs,
                        backend=backend, parallel_config=parallel_config)

    return tag("attention", dispatch_attention_fn)


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
          **kwargs: Any) -> torch.Tensor:
    """torch's F.scaled_dot_product_attention as attention_processor.py sees it: ours (q/k/v [B, N, S, D]) inside
    an accelerated denoiser, torch's otherwise."""
    if routed("attention") and not enable_gqa and not kwargs and query.dim() == 4:
        return dit_attention(query, key, value, "BNSD", attn_mask, dropout_p, scale, is_causal)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, **kwargs)


class RoutedFunctional(types.ModuleType):
    """torch.nn.functional for attention_processor.py (its `F`): every name is torch's, except
    scaled_dot_product_attention (routed, above)."""

    scaled_dot_product_attention = staticmethod(tag("attention", _sdpa))

    def __init__(self) -> None:
        super().__init__("torch.nn.functional")

    def __getattr__(self, name: str) -> Any:
        return getattr(F, name)


# ----------------------------------------------------------------------------------------------------------- rope
def rope_function(original: Callable) -> Callable:
    """embeddings.apply_rotary_emb(x, (cos, sin) [S, D], use_real=True, use_real_unbind_dim, sequence_dim): ours for
    real tables (interleaved pairs: -1, halves: -2) on 4-D x; anything else diffusers'."""

    @functools.wraps(original)
    def apply_rotary_emb(x: torch.Tensor, freqs_cis: Any, use_real: bool = True, use_real_unbind_dim: int = -1,
                         sequence_dim: int = 2) -> torch.Tensor:
        if (routed("rope") and use_real and use_real_unbind_dim in (-1, -2) and sequence_dim in (1, 2)
                and x.dim() == 4 and isinstance(freqs_cis, (tuple, list)) and freqs_cis[0].dim() == 2):
            cos, sin = (t.to(x.device) for t in freqs_cis)
            shape = (1, 1, *cos.shape) if sequence_dim == 2 else (1, cos.shape[0], 1, cos.shape[1])
            return dit_rope(x, cos.view(shape), sin.view(shape), "interleave" if use_real_unbind_dim == -1 else "half")
        return original(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)

    return tag("rope", apply_rotary_emb)


def _complex_tables(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """complex_tables(freqs) computed once per frequency tensor (each layer's q and k of a step share one)."""
    key = (id(freqs), freqs._version)
    hit = _tables.get(key)
    if hit is not None and hit[0] is freqs:
        return hit[1]
    tables = complex_tables(freqs)
    _tables[key] = (freqs, tables)
    while len(_tables) > _TABLES:
        _tables.popitem(last=False)
    return tables


def qwen_rope_function(original: Callable) -> Callable:
    """Qwen-Image's apply_rotary_emb_qwen(x [B, S, N, D], freqs_cis complex [S, D/2], use_real=False): the complex
    product is the interleaved rotation by the frequencies' real / imaginary parts."""

    @functools.wraps(original)
    def apply_rotary_emb_qwen(x: torch.Tensor, freqs_cis: Any, use_real: bool = True,
                              use_real_unbind_dim: int = -1) -> torch.Tensor:
        if (routed("rope") and not use_real and x.dim() == 4 and isinstance(freqs_cis, torch.Tensor)
                and freqs_cis.is_complex() and freqs_cis.dim() == 2):
            cos, sin = _complex_tables(freqs_cis)
            shape = (1, cos.shape[0], 1, cos.shape[1])
            return dit_rope(x, cos.view(shape), sin.view(shape), "interleave")
        return original(x, freqs_cis, use_real, use_real_unbind_dim)

    return tag("rope", apply_rotary_emb_qwen)


def local_rope_call(original: Callable, embeddings: types.ModuleType, ours: Callable) -> Callable:
    """A processor `__call__` that imports embeddings.apply_rotary_emb inside itself (HunyuanVideo): for the length
    of the call the module attribute is `ours` (the routed rope function), then the original again."""

    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not routed("rope"):
            return original(self, *args, **kwargs)
        previous = embeddings.apply_rotary_emb
        embeddings.apply_rotary_emb = ours
        try:
            return original(self, *args, **kwargs)
        finally:
            embeddings.apply_rotary_emb = previous

    return __call__


# ------------------------------------------------------------------------------------------ norms and activations
def rms_norm_forward(original: Callable) -> Callable:
    """An RMSNorm class's forward (torch.nn.RMSNorm, diffusers' RMSNorm): the fused kernel inside a denoiser."""

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return dit_rms_norm(self, hidden_states, original)

    return switch("rms_norm", forward, original)


def swiglu_forward(original: Callable) -> Callable:
    """Flux.2's packed SwiGLU activation (silu(first half) * second half): the fused SwiGLU kernel."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(getattr(self, "gate_fn", None), nn.SiLU) or x.shape[-1] % 2:
            return original(self, x)
        return swiglu_packed(x)

    return switch("swiglu", forward, original)
