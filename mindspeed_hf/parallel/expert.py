"""Expert parallelism (EP) for transformers' fused MoE experts: expert sharding, token dispatch, gradient scaling.

With ``parallel.ep = N`` every experts module (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, forward
``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``; transformers >= 5) keeps E/N experts per rank:

* the two weights become DTensors ``Shard(0)`` on the ``ep`` mesh (so state dicts, DCP and the consolidated HF
  export see the global ``[E, ...]`` tensors), later ``fully_shard``-ed on ``expert_fsdp`` (``efsdp``, or
  ``(dp_replicate, efsdp)``) before their decoder layer (:func:`expert_fsdp_groups`, used by the fsdp step);
* the module's forward is replaced on the instance (:func:`remove_expert_parallel` puts it back): tokens are
  grouped by global expert (``ops.experts.permute``), the per-expert counts are exchanged (``all_to_all_single``),
  the rows travel to the rank owning their expert (an autograd all-to-all: its backward is the reverse exchange),
  are regrouped by local expert, run through ``ops.experts.grouped_mlp`` on the local weights, travel back, and
  ``ops.experts.unpermute`` applies the routing weights in fp32. The router stays replicated: router logits and
  the auxiliary loss are HF's own.

Gradient scale (the ep-times trap): an expert's local gradient already sums the contributions of every rank of
its ep group, and FSDP then averages over ``expert_fsdp`` only (dp_replicate x efsdp ranks), not over the data
ranks. The local weights are therefore used through a gradient scale of 1/ep, so that an expert gradient is the
mean over all world ranks exactly like a dense one (FSDP averages those over dp_replicate x dp_shard x cp). This
needs no PREMUL_SUM reduction (gloo and HCCL have none) and keeps one rule for the loss (Trainer's
``num_items_in_batch`` scaling) for dense and expert parameters alike.

A model transformers already split (``from_pretrained(..., distributed_config=DistributedConfig(ep_size=N))``) is
adopted as loaded when ``parallel.ep`` is unset (:func:`adopt_native_ep`): its dispatch, expert sharding and FSDP2
stay, nothing is sharded twice; both set, or another data layout, is a one-line error naming both settings.

Parameters then live on two meshes: :func:`clip_grad_norm_` computes the norm per mesh and combines them (torch's
``clip_grad_norm_`` cannot mix meshes); transformers 5's Trainer does the same by itself (``_mixed_mesh_grad_norm``),
and groups the optimizer's tensors by mesh.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..ops.experts import grouped_mlp, permute, unpermute
from ..patches.experts import FUSED_EXPERT_WEIGHTS as _WEIGHTS
from ..patches.experts import find_fused_experts, gate_of
from .dims import ParallelDims

__all__ = [
    "adopt_native_ep",
    "apply_expert_parallel",
    "check_expert_parallel",
    "clip_grad_norm_",
    "expert_fsdp_groups",
    "find_fused_experts",
    "native_expert_parallel",
    "remove_expert_parallel",
]


@dataclass(frozen=True)
class _EpState:
    """What the replaced forward needs: the ep group and the global expert count."""

    group: dist.ProcessGroup
    ep: int
    num_experts: int
    rank: int  # this rank's place on the ep mesh: its experts start at rank * num_experts / ep
    adapters: tuple[nn.Module, ...] = ()  # PEFT ParamWrappers (LoRA on gate_up_proj / down_proj), outermost first


# ---------------------------------------------------------------------------------------------- finding, checking
def native_expert_parallel(model: nn.Module) -> str | None:
    """Name of the first experts module transformers itself split (``from_pretrained(...,
    distributed_config=DistributedConfig(ep_size=N))``), or None."""
    return next((name for name, m in model.named_modules() if getattr(m, "_is_expert_parallel", False)), None)


def _their_sizes(model: nn.Module) -> dict[str, int]:
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    names = ("ep_size", "fsdp_size", "dp_replicate_size", "tp_size", "pp_size")
    return {name: int(getattr(config, name, None) or 1) for name in names}


def adopt_native_ep(model: nn.Module, dims: ParallelDims, ep: int) -> bool:
    """True when `model` was split by transformers' own expert parallelism and is adopted as it is: its experts
    sharding, token dispatch and FSDP2 (experts on ``efsdp``, gradients divided by the data size; measured exact
    against one process) stay, and mindspeed_hf shards nothing a second time. A one-line ValueError naming both
    settings when they cannot combine: ``parallel.ep > 1`` too, tensor / pipeline parallelism, or mindspeed_hf
    parallel sizes that lay the data ranks out otherwise than the DistributedConfig."""
    name = native_expert_parallel(model)
    if name is None:
        return False
    theirs = _their_sizes(model)
    loaded = "DistributedConfig(" + ", ".join(f"{k}={v}" for k, v in theirs.items()) + ")"
    if ep > 1:
        raise ValueError(f"parallel.ep={ep} and transformers' {loaded} both split the experts ({name}); valid "
                         "choices: parallel.ep=1 to keep transformers' expert parallelism as loaded, or load the "
                         "model without distributed_config to use parallel.ep")
    ours = {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp}
    want = {"dp_replicate": theirs["dp_replicate_size"], "dp_shard": theirs["fsdp_size"], "cp": 1}
    if ours != want or theirs["tp_size"] > 1 or theirs["pp_size"] > 1:
        sizes = ", ".join(f"{k}={v}" for k, v in ours.items())
        valid = ", ".join(f"parallel.{k}={v}" for k, v in want.items())
        raise ValueError(f"parallel: the model was loaded with transformers' expert parallelism ({loaded}), which "
                         f"mindspeed_hf adopts only with the same data layout and no tp / pp; got {sizes}; valid "
                         f"choices: {valid} (tp_size=pp_size=1), or load the model without distributed_config and "
                         "set parallel.ep")
    return True


def unsupported_layout(module: nn.Module) -> str | None:
    """Why a fused experts module's layout is not the one EP (and tp's experts sharding) implements: gate and up
    concatenated in ``gate_up_proj [E, 2I, H]``, no biases, not transposed; None when it is."""
    for flag, bad in (("has_bias", True), ("is_transposed", True), ("has_gate", False), ("is_concatenated", False)):
        if getattr(module, flag, not bad) == bad:
            return f"{flag}={bad}"
    return None


def check_expert_parallel(model: nn.Module, ep: int) -> list[tuple[str, nn.Module]]:
    """The experts modules EP will shard; a one-line ValueError naming ``parallel.ep`` when it cannot apply."""
    from ..releases.supported import check_ep_release

    check_ep_release(ep)
    experts = find_fused_experts(model)
    kind = type(model).__name__
    if not experts:
        raise ValueError(f"parallel.ep={ep}: {kind} has no fused experts module (gate_up_proj [E, 2I, H], down_proj "
                         "[E, H, I]); expert parallelism applies to transformers' MoE families; valid choices: "
                         "parallel.ep=1 for this model")
    for name, module in experts:
        layout = unsupported_layout(module)
        if layout:
            raise ValueError(f"parallel.ep={ep}: experts {name} ({type(module).__name__}) have an unsupported layout "
                             f"({layout}); valid choices: parallel.ep=1 for this model")
        count = module.gate_up_proj.shape[0]
        if count % ep:
            raise ValueError(f"parallel.ep={ep} must divide the number of experts ({count} in {name}); valid choices:"
                             f" {[d for d in range(1, count + 1) if count % d == 0]}")
    return experts


# ---------------------------------------------------------------------------------------------- the exchange
class _AllToAll(torch.autograd.Function):
    """Rows of `x` split by `in_splits` go to the ranks of `group`; `out_splits` rows arrive from each. The
    backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        in_splits, out_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
              group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` (the 1/ep of the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def expert_major_index(counts: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Rows received as ``[source rank][local expert]`` blocks (``counts`` [ep, E_local]): the row indices that
    list them ``[local expert][source rank]`` instead, i.e. grouped by local expert. `total` (the number of rows,
    when the caller knows it) saves a host read."""
    flat = counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # block starts, source-major
    em_counts = counts.t().reshape(-1)
    em_starts = starts.view_as(counts).t().reshape(-1)
    total = int(flat.sum()) if total is None else total
    within = torch.arange(total, device=counts.device) - torch.repeat_interleave(
        torch.cumsum(em_counts, 0) - em_counts, em_counts, output_size=total)
    return torch.repeat_interleave(em_starts, em_counts, output_size=total) + within


def peft_expert_adapters(model: nn.Module) -> dict[int, tuple[nn.Module, ...]]:
    """id(experts module) -> the PEFT ``ParamWrapper`` modules (LoRA through ``target_parameters``) around it."""
    found: dict[int, tuple[nn.Module, ...]] = {}
    for module in model.modules():
        if type(module).__name__ == "ParamWrapper" and callable(getattr(module, "get_base_layer", None)):
            base = module.get_base_layer()
            found[id(base)] = (*found.get(id(base), ()), module)
    return found


def _passthrough(self: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A PEFT ParamWrapper's forward under EP: straight to the wrapped module (the EP forward adds the deltas of
    its local experts instead of PEFT's parametrization of the whole, sharded, weight)."""
    return self.base_layer(x, *args, **kwargs)


def _with_adapters(weight: torch.Tensor, name: str, state: _EpState) -> torch.Tensor:
    """`weight` (the local experts of parameter `name`) plus the LoRA deltas of those experts, computed by PEFT
    (`get_delta_weight`) and sliced to this rank's experts. The LoRA factors are dense parameters, averaged over
    all ranks by FSDP like any other, so their path takes no 1/ep scale."""
    start = state.rank * weight.shape[0]
    for wrapper in state.adapters:
        if wrapper.parameter_name != name or wrapper.disable_adapters or wrapper.merged:
            continue
        for adapter in wrapper.active_adapters:
            if adapter in wrapper.lora_A:
                weight = weight + wrapper.get_delta_weight(adapter)[start:start + weight.shape[0]]
    return weight


def _local(weight: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return weight.to_local() if isinstance(weight, DTensor) else weight


def expert_parallel_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts forward under EP (installed on the instance): dispatch, local experts, combine."""
    state: _EpState = self._mindspeed_ep
    scale = 1.0 / state.ep
    gate_up = _with_adapters(_ScaleGrad.apply(_local(self.gate_up_proj), scale), "gate_up_proj", state)
    down = _with_adapters(_ScaleGrad.apply(_local(self.down_proj), scale), "down_proj", state)
    local_experts = gate_up.shape[0]
    rows, routing = permute(hidden_states, top_k_index, state.num_experts)
    sent = routing.counts
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=state.group)
    received = received.view(state.ep, local_experts)
    # the block's one host read: rows sent to / received from each rank, and rows per local expert
    sizes = torch.cat([sent.view(state.ep, local_experts).sum(1), received.sum(1), received.sum(0)]).tolist()
    in_splits, out_splits, per_expert = sizes[:state.ep], sizes[state.ep:2 * state.ep], sizes[2 * state.ep:]
    arrived = _AllToAll.apply(rows, out_splits, in_splits, state.group)
    if arrived.shape[0]:
        index = expert_major_index(received, arrived.shape[0])
        out = grouped_mlp(arrived.index_select(0, index), per_expert, gate_up, down, gate_of(self))
        out = out.index_select(0, torch.argsort(index))  # back to [source rank][expert] order
    else:  # no token for any local expert: backward must still reach the exchange (its peers wait) and the
        # weights (zero gradients, so FSDP's reduce-scatter runs on every rank)
        out = arrived * 0 + (gate_up.sum() + down.sum()) * 0
    returned = _AllToAll.apply(out, in_splits, out_splits, state.group)
    return unpermute(returned, routing, top_k_weights)


# ---------------------------------------------------------------------------------------------- applying
def _shard_param(module: nn.Module, name: str, mesh: DeviceMesh) -> None:
    from torch.distributed.tensor import DTensor, Shard

    param = getattr(module, name)
    if isinstance(param, DTensor):
        raise ValueError(f"parallel.ep: {type(module).__name__}.{name} is already a DTensor (sharded before, e.g. "
                         "by transformers' DistributedConfig(ep_size=...)); shard it once: valid choices: "
                         "parallel.ep=1 with a model loaded that way, or a model loaded without distributed_config")
    ep, rank = mesh.size(), mesh.get_local_rank()
    per = param.shape[0] // ep
    local = param.detach()[rank * per:(rank + 1) * per].clone()
    dtensor = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                 shape=param.shape, stride=param.stride())
    setattr(module, name, nn.Parameter(dtensor, requires_grad=param.requires_grad))


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
    """Shard every fused experts module of `model` on dim 0 over the 1-D ``ep`` mesh and install the EP forward;
    returns the experts modules. Parameters may be on ``meta`` (materialised later, e.g. by rank-0 broadcast)."""
    ep = mesh.size()
    experts = [module for _, module in check_expert_parallel(model, ep)]
    adapters = peft_expert_adapters(model)
    for module in experts:
        wrappers = adapters.get(id(module), ())
        state = _EpState(mesh.get_group(), ep, module.gate_up_proj.shape[0], mesh.get_local_rank(), wrappers)
        for name in _WEIGHTS:
            _shard_param(module, name, mesh)
        module._mindspeed_ep = state
        module.forward = types.MethodType(expert_parallel_forward, module)
        for wrapper in wrappers:
            wrapper.forward = types.MethodType(_passthrough, wrapper)
    return experts


def remove_expert_parallel(model: nn.Module) -> None:
    """Put each experts module's own forward back (the weights stay as they are: sharded DTensors)."""
    for module in model.modules():
        if "_mindspeed_ep" in vars(module):
            for wrapper in module._mindspeed_ep.adapters:
                vars(wrapper).pop("forward", None)
            vars(module).pop("forward", None)
            del module._mindspeed_ep


def expert_fsdp_groups(model: nn.Module, mesh: DeviceMesh) -> list[tuple[nn.Module, DeviceMesh]]:
    """(experts module, mesh) for each module :func:`apply_expert_parallel` prepared: FSDP shards them on
    ``expert_fsdp`` before their decoder layer, which then leaves their parameters alone."""
    return [(module, mesh) for module in model.modules() if "_mindspeed_ep" in vars(module)]


# ---------------------------------------------------------------------------------------------- gradient norm
def _mesh_of(t: torch.Tensor) -> DeviceMesh | None:
    from torch.distributed.tensor import DTensor

    return t.device_mesh if isinstance(t, DTensor) else None


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` for parameters on several device meshes (dense and experts): the norm of each
    mesh's gradients (complete over that mesh), combined, then every gradient clipped by the total. Returns the
    total norm (a plain tensor, the same on every rank)."""
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    by_mesh: dict[DeviceMesh | None, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(_mesh_of(p.grad), []).append(p)
    norms = []
    for params in by_mesh.values():
        norm = get_total_norm([p.grad for p in params], norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    total = get_total_norm(norms, norm_type)
    for params in by_mesh.values():
        clip_grads_with_norm_(params, max_norm, total)
    return total
