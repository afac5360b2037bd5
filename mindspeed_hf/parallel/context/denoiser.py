"""Context parallelism for diffusers' DiT denoisers (Flux, Wan): the image / video tokens split over the cp group.

Where to split and gather is the model's own `_cp_plan` (diffusers writes one per model: which forward inputs are
split along the sequence, which outputs are split (the rope tables) and where the output is gathered). The plan is
applied here with our own hooks rather than diffusers' (hooks/context_parallel.py), and its attention with ours:

- diffusers' gather returns each rank's slice of the output gradient as is. With the loss computed on the gathered
  output (the same on every rank, what an unmodified training script does) every parameter's gradient is then this
  rank's share (Flux's and Wan's plans gather after their last parameter), to be summed over the cp group; our
  gather scales it by cp, so that the mean over the cp group (what FSDP2 over dp_shard x cp takes, as for the
  transformers models' context parallelism, model.py) is the one-process gradient.
- diffusers' ring on NPU has no backward (`_npu_attention_backward_op` raises), and its native ring needs the
  log-sum-exp of a backend that has one. Ours is `context_attention` (ring across, Ulysses inside, either optional)
  on the device block kernels with their log-sum-exp (npu_fusion_attention / _grad on NPU).

Which attention calls run over the group is what diffusers' processors already say: they pass their
`_parallel_config` to the dispatcher only for the attention over the split sequence (Flux's joint text + image
attention, Wan's self-attention; Wan's cross-attention over the whole text runs locally). The processors get a
`DenoiserContext` there, which the dispatcher site (patches/diffusion/sites.py) hands the call to.

Every rank of a cp group must see the same batch and draw the same noise (one data-parallel rank, as for any cp);
each split sequence's length (image / video tokens, and Flux's text tokens, split too for its joint attention) must
be a multiple of cp.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .hybrid import context_attention
from .model import ContextParallel
from .ulysses import check_ulysses_heads

#: The denoiser families whose cp plan needs no attention mask on the split sequence (tested).
SUPPORTED = ("flux", "wan")
_HOOKS = "_mindspeed_cp_hooks"


@dataclass(frozen=True)
class DenoiserContext:
    """One rank's cp group for a denoiser; set as `_parallel_config` of its attention processors."""

    ctx: ContextParallel

    def mindspeed_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attn_mask: torch.Tensor | None, dropout_p: float, scale: float | None,
                            is_causal: bool) -> torch.Tensor:
        """The dispatcher's call (q / k / v [B, S_local, N, D]) as attention over the whole group's sequence."""
        if attn_mask is not None or dropout_p or is_causal:
            raise ValueError("parallel.cp > 1: a denoiser attention with a mask, dropout or causal attention cannot "
                             "be split over the cp group; valid choices: parallel.cp=1 for this model")
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        out = context_attention(q, k, v, ring_group=self.ctx.ring_group, ulysses_group=self.ctx.ulysses_group,
                                causal=False, scale=scale if scale is not None else query.shape[-1] ** -0.5)
        return out.transpose(1, 2)


class _Gather(torch.autograd.Function):
    """All-gather along `dim` in cp rank order; backward: this rank's slice of the gradient times cp."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group, rank: int, world: int) -> torch.Tensor:
        ctx.dim, ctx.rank, ctx.world = dim, rank, world
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.world, dim=ctx.dim)[ctx.rank] * ctx.world, None, None, None, None


def _split(x: Any, spec: Any, ctx: ContextParallel, where: str) -> Any:
    if not isinstance(x, torch.Tensor) or (spec.expected_dims is not None and x.dim() != spec.expected_dims):
        return x  # diffusers' rule: a tensor of another rank is not split (Wan's 1-D timesteps)
    size = x.shape[spec.split_dim]
    if size % ctx.cp:
        raise ValueError(f"parallel.cp={ctx.cp}: {where} has {size} tokens along dim {spec.split_dim}, not a "
                         f"multiple of cp; valid choices: a cp dividing {size}, or inputs whose length it divides")
    return x.chunk(ctx.cp, dim=spec.split_dim)[ctx.rank]


def _split_inputs(module: nn.Module, plan: dict, ctx: ContextParallel):
    names = list(inspect.signature(type(module).forward).parameters)[1:]

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = list(args)
        for name, spec in plan.items():
            if isinstance(name, int) or getattr(spec, "split_output", False):
                continue
            where = f"{type(mod).__name__}'s {name}"
            if name in kwargs:
                kwargs[name] = _split(kwargs[name], spec, ctx, where)
            elif name in names and names.index(name) < len(args):
                i = names.index(name)
                args[i] = _split(args[i], spec, ctx, where)
        return tuple(args), kwargs

    return hook


def _split_outputs(plan: dict, ctx: ContextParallel):
    def hook(mod: nn.Module, args: tuple, output: Any) -> Any:
        single = isinstance(output, torch.Tensor)
        out = [output] if single else list(output)
        for index, spec in plan.items():
            if isinstance(index, int) and spec.split_output:
                out[index] = _split(out[index], spec, ctx, f"{type(mod).__name__}'s output {index}")
        return out[0] if single else type(output)(out)

    return hook


def _gather_outputs(specs: list, ctx: ContextParallel):
    def hook(mod: nn.Module, args: tuple, output: Any) -> Any:
        single = isinstance(output, torch.Tensor)
        out = [output] if single else list(output)
        for i, spec in enumerate(specs):
            if spec is not None and isinstance(out[i], torch.Tensor):
                out[i] = _Gather.apply(out[i], spec.gather_dim, ctx.group, ctx.rank, ctx.cp)
        return out[0] if single else type(output)(out)

    return hook


def _modules(model: nn.Module, name: str) -> list[nn.Module]:
    """The submodules a plan key names ("" the model, "blocks.0", "transformer_blocks.*")."""
    found = [model]
    for atom in name.split(".") if name else []:
        found = [child for m in found for child in (list(m) if atom == "*" else [getattr(m, atom)])]
    return found


def apply_denoiser_context_parallel(model: nn.Module, ctx: ContextParallel, family: str) -> None:
    """Split `model`'s sequence over the cp group `ctx` by its `_cp_plan`, and route the processors' attention over
    the split sequence to `context_attention`. Refused in one line for a family without a supported plan, or heads
    that the Ulysses size does not divide."""
    plan = getattr(type(model), "_cp_plan", None)
    if family not in SUPPORTED or not plan:
        raise ValueError(f"parallel.cp={ctx.cp}: context parallelism for diffusers' {type(model).__name__} "
                         f"({family}) is not supported; valid choices: parallel.cp=1, or a model of "
                         f"{', '.join(SUPPORTED)}")
    heads = {m.heads for m in model.modules() if hasattr(m, "processor") and isinstance(getattr(m, "heads", None),
                                                                                      int)}
    for n in heads:
        check_ulysses_heads(n, n, ctx.ulysses)
    remove_denoiser_context_parallel(model)
    handles = []
    for name, entry in plan.items():
        for module in _modules(model, name):
            if isinstance(entry, dict):
                handles.append(module.register_forward_pre_hook(_split_inputs(module, entry, ctx), with_kwargs=True))
                if any(isinstance(k, int) for k in entry):
                    handles.append(module.register_forward_hook(_split_outputs(entry, ctx)))
            else:
                specs = list(entry) if isinstance(entry, (list, tuple)) else [entry]
                handles.append(module.register_forward_hook(_gather_outputs(specs, ctx)))
    context = DenoiserContext(ctx)
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = context
    model.__dict__[_HOOKS] = handles


def remove_denoiser_context_parallel(model: nn.Module) -> None:
    """Take the split / gather hooks and the processors' context off again."""
    for handle in model.__dict__.pop(_HOOKS, []):
        handle.remove()
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if isinstance(getattr(processor, "_parallel_config", None), DenoiserContext):
            processor._parallel_config = None
