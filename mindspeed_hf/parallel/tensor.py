"""Tensor parallelism (TP): Megatron-style column / row sharding from the family's own plan, sequence parallelism.

``apply_tensor_parallel(model, tp_mesh)`` shards a transformers causal LM over the 1-D ``tp`` mesh with torch's
``parallelize_module`` and DTensor, reading which projection is column- and which row-parallel from the model's
``config.base_model_tp_plan`` (llama, qwen3, qwen3_moe, ... in transformers 5.24):

* ``colwise`` (q/k/v, gate/up): weight ``Shard(0)``, plain replicated input, the LOCAL output slice (heads or
  intermediate features of this rank; HF's attention views it with ``-1`` heads, so it sees its local heads);
* ``rowwise`` (o, down): weight ``Shard(1)``, the partial sums reduced: all-reduce, or under sequence parallelism a
  reduce-scatter onto sequence shards (a DTensor ``Shard(1)``: the residual stream);
* ``replicated_with_grad_allreduce`` (Qwen3's per-head q_norm / k_norm): replicated weight, its gradient summed
  over tp (each rank normalises only its heads);
* fused experts (Qwen3-MoE's ``gate_up_proj [E, 2I, H]``; transformers <= 5.24 plans them ``moe_tp_experts`` with
  ``packed_colwise`` gate_up_proj / ``rowwise`` down_proj, 5.25 leaves them out, and we shard them either way): each
  rank keeps the gate and the up slice of every expert's intermediate dim (``_StridedShard(1, split_factor=2)``)
  and the matching down slice (``Shard(2)``); the router is replicated, the partial outputs all-reduced, the
  gradients of the (replicated) tokens and routing weights all-reduced;
* a PEFT LoRA layer on a projection: its base layer as above; on a colwise one A replicated and B colwise, on a
  rowwise one A rowwise and B replicated (``_lora_styles``);
* embeddings: vocab-parallel (``Shard(0)``, masked lookup, partial sums reduced); lm_head: HF's own class plan
  ``colwise_gather_output`` (weight ``Shard(0)``; the fused loss scores each vocab slice where it is: below).

The loss: the chunked fused loss (ops/fused_linear_cross_entropy.py) sees the lm_head's DTensor ``Shard(0)`` weight
and scores each chunk on this rank's vocabulary slice (ops/vocab_parallel.py: [chunk, V/tp] logits, never gathered;
row max, sum-exp and target logit all-reduced over tp). A head it cannot take so (PEFT LoRA on lm_head, final-logit
softcapping) is called as a module: each chunk's logits gathered over tp ([chunk, V], never [tokens, V]).

Sequence parallelism (``sequence_parallel=True``): between layers the hidden states are DTensors ``Shard(1)`` on
tp; the residual-stream norms run on the local sequence shard with the replicated weight (their gradient summed
over tp, as torch's SequenceParallel does); the attention and the MLP gather the sequence on entry
(``PrepareModuleInput``); the final norm's output is gathered, so ``last_hidden_state`` is a plain full tensor.

Our kernels take plain tensors: every module that runs one (norms, MLP with swiglu, attention with rope and the
``mindspeed`` attention, experts) gets local tensors: projections return their local output
(``use_local_output``), and the norms, router and experts run their forward with their DTensor parameters swapped
for local views (``_LocalForward``), so the patched class forwards run unchanged on the shards.

One-way, like FSDP: the parameters become DTensors and torch's styles register hooks without handles, so there
is no ``remove_tensor_parallel``; rebuild the model to undo it.
"""

from __future__ import annotations

import contextlib
import math
import re
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from packaging.version import Version
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from ..ops.vocab_parallel import GradAllReduce, vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy
from ..releases.supported import installed
from .expert import find_fused_experts, unsupported_layout
from .fsdp import unwrap_hf_model

__all__ = ["apply_tensor_parallel", "check_tensor_parallel", "tensor_parallel_plan", "vocab_parallel_cross_entropy",
           "vocab_parallel_linear_cross_entropy"]

#: styles of base_model_tp_plan this step implements; anything else is refused before any work
TP_MIN_TRANSFORMERS = "5.0"
KNOWN_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce", "moe_tp_experts", "packed_colwise")
_NORM = re.compile(r"^(layers\.\d+\.[^.]*norm|norm)$")


# ---------------------------------------------------------------------------------------------- checks and plan
def _text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tensor_parallel(model: nn.Module, tp: int) -> dict[str, str]:
    """The family's ``base_model_tp_plan`` (pattern -> style), checked: a one-line ValueError naming
    ``parallel.tp`` and the valid choices when the heads (or intermediate sizes) do not divide by `tp`, the model
    has no plan, a style is unknown, or the embeddings are tied."""
    hf_model = unwrap_hf_model(model)
    config = _text_config(hf_model)
    kind = type(hf_model).__name__
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not plan:
        raise ValueError(f"parallel.tp={tp}: {kind} declares no base_model_tp_plan; valid choices: parallel.tp=1")
    found = installed("transformers")
    if found is not None and found < Version(TP_MIN_TRANSFORMERS):
        # 4.57's plans leave Qwen3's q/k norms out (their gradients would not be summed over tp) and give MoE one
        # entry per expert module
        raise ValueError(f"parallel.tp={tp}: tensor parallelism needs transformers >= {TP_MIN_TRANSFORMERS} (its "
                         f"tp plans), transformers {found} is installed; valid choices: parallel.tp=1")
    unknown = sorted({s for s in plan.values() if s not in KNOWN_STYLES})
    if unknown:
        raise ValueError(f"parallel.tp={tp}: {kind}'s tp plan uses styles this step does not implement ({unknown});"
                         " valid choices: parallel.tp=1")
    sizes = {name: getattr(config, name, None) for name in
             ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size")}
    sizes = {k: int(v) for k, v in sizes.items() if v}
    common = math.gcd(*sizes.values())
    if tp < 1 or common % tp:
        given = ", ".join(f"{k}={v}" for k, v in sizes.items())
        raise ValueError(f"parallel.tp={tp} must divide the attention heads and intermediate sizes of {kind} "
                         f"({given}); valid choices: {_divisors(common)}")
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError(f"parallel.tp={tp}: {kind} ties lm_head to the embeddings (tie_word_embeddings=True), which "
                         "this step shards apart (vocab-parallel embedding, gathered lm_head); valid choices: "
                         "parallel.tp=1 for this model")
    return plan


def _matches(pattern: str, name: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name) is not None


def tensor_parallel_plan(base: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Module name (inside the backbone) -> style, for every module of `base` a pattern of `plan` names. Entries
    naming parameters (``experts.gate_up_proj``) are read by the experts style, not returned."""
    found = {}
    for name, _ in base.named_modules():
        style = next((s for p, s in plan.items() if _matches(p, name)), None)
        if style is not None:
            found[name] = style
    return found


# ---------------------------------------------------------------------------------------------- autograd pieces
class _SumForward(torch.autograd.Function):
    """The partial outputs of the ranks summed over `group`; the gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


# ---------------------------------------------------------------------------------------------- local forwards
@dataclass(frozen=True)
class _TpState:
    """How a module's forward runs on local tensors (installed on the instance by ``_LocalForward``)."""

    mesh: DeviceMesh
    original: Callable  # the forward it had (the patched class forward when mindspeed_hf is enabled)
    reduce_grad: bool = False  # parameter gradients summed over tp (norms on sequence shards or on local heads)
    sequence_input: bool = False  # input: a DTensor Shard(1) (sequence parallelism)
    output: str = "local"  # "local", "shard" (DTensor Shard(1)) or "gather" (plain full sequence)
    experts: bool = False  # tokens / routing weights replicated in, partial outputs summed out


@contextlib.contextmanager
def _local_params(module: nn.Module, group: dist.ProcessGroup, reduce_grad: bool) -> Iterator[None]:
    """Inside: the module's DTensor parameters are their local tensors (autograd-connected to them)."""
    saved = dict(module._parameters)
    try:
        for name, param in saved.items():
            if isinstance(param, DTensor):
                local = param.to_local()
                if reduce_grad and param.requires_grad and torch.is_grad_enabled():
                    local = GradAllReduce.apply(local, group)
                module._parameters[name] = local
        yield
    finally:
        module._parameters.update(saved)


def _local_forward(self: nn.Module, *args, **kwargs):
    """A forward run on local tensors: see ``_TpState``."""
    state: _TpState = self._mindspeed_tp
    group = state.mesh.get_group()
    x, *rest = args
    global_x = x if isinstance(x, DTensor) else None
    if global_x is not None:
        x = global_x.to_local()
    if state.experts and torch.is_grad_enabled():
        x = GradAllReduce.apply(x, group)
        if len(rest) >= 2:
            rest[1] = GradAllReduce.apply(rest[1], group)
    with _local_params(self, group, state.reduce_grad):
        out = state.original(x, *rest, **kwargs)
    if state.experts:
        return _SumForward.apply(out, group)
    if global_x is None or state.output == "local":
        return out
    shape = (*global_x.shape[:-1], out.shape[-1])  # a norm keeps the feature size, a LoRA B changes it
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    out = DTensor.from_local(out, state.mesh, global_x.placements, run_check=False, shape=torch.Size(shape),
                             stride=stride)
    return out if state.output == "shard" else out.redistribute(placements=[Replicate()]).to_local()


_local_forward._mindspeed_transparent = True  # it runs the forward the module had (report()'s replacements)


def _shard_experts(module: nn.Module, mesh: DeviceMesh) -> None:
    """gate_up_proj [E, 2I, H]: this rank's slice of the gate half and of the up half (``_StridedShard(1, 2)``);
    down_proj [E, H, I]: ``Shard(2)``. The full tensors come from rank 0 (as torch's styles distribute them)."""
    tp, rank = mesh.size(), mesh.get_local_rank()
    gate_up, down = module.gate_up_proj, module.down_proj
    full = gate_up.detach().clone()
    dist.broadcast(full, src=dist.get_global_rank(mesh.get_group(), 0), group=mesh.get_group())
    halves = [h.chunk(tp, dim=1)[rank] for h in full.chunk(2, dim=1)]
    local = torch.cat(halves, dim=1).contiguous()
    sharded = DTensor.from_local(local, mesh, [_StridedShard(1, split_factor=2)], run_check=False,
                                 shape=gate_up.shape, stride=gate_up.stride())
    module.gate_up_proj = nn.Parameter(sharded, requires_grad=gate_up.requires_grad)
    module.down_proj = nn.Parameter(distribute_tensor(down.detach(), mesh, [Shard(2)]),
                                    requires_grad=down.requires_grad)


class _LocalForward(ParallelStyle):
    """Replicated parameters (or the experts' shards) as DTensors; the forward runs on local tensors."""

    def __init__(self, **state) -> None:
        super().__init__()
        self.state = state

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.state.get("experts"):
            _shard_experts(module, device_mesh)
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                replicated = distribute_tensor(param.detach(), device_mesh, [Replicate()])
                module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        module._mindspeed_tp = _TpState(device_mesh, module.forward, **self.state)
        module.forward = types.MethodType(_local_forward, module)
        return module


# ---------------------------------------------------------------------------------------------- the plan
def _projection_style(style: str, sequence_parallel: bool) -> ParallelStyle:
    if style == "colwise":
        return ColwiseParallel()
    if sequence_parallel:  # rowwise: partial sums reduce-scattered onto sequence shards
        return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return RowwiseParallel()


def _experts_styles(base: nn.Module, plan: dict[str, str]) -> dict[str, ParallelStyle]:
    """Every fused experts module of the layout ``_shard_experts`` implements is sharded over tp, whether or not the
    family's plan names it: transformers <= 5.24 plans it (``moe_tp_experts``, ``packed_colwise`` gate_up_proj,
    ``rowwise`` down_proj), 5.25 dropped those entries for expert parallelism, which would leave every expert
    whole on every tp rank. Entries the plan does give must be that layout; another layout stays replicated."""
    styles: dict[str, ParallelStyle] = {}
    want = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
    for name, module in find_fused_experts(base):
        for param, style in want.items():
            got = next((s for p, s in plan.items() if _matches(p, f"{name}.{param}")), None)
            if got not in (None, style):
                raise ValueError(f"parallel.tp: experts {name}.{param} have tp style {got!r}, this step shards "
                                 f"{style!r} only; valid choices: parallel.tp=1 for this model")
        if unsupported_layout(module) is None:
            styles[name] = _LocalForward(experts=True)
    return styles


def _is_lora(module: nn.Module) -> bool:
    """A PEFT LoRA layer around a projection: `base_layer` plus `lora_A` / `lora_B` (one Linear per adapter)."""
    return (isinstance(getattr(module, "base_layer", None), nn.Linear)
            and isinstance(getattr(module, "lora_A", None), nn.ModuleDict))


def _lora_styles(name: str, module: nn.Module, style: str, sp: bool) -> dict[str, ParallelStyle]:
    """LoRA on a sharded projection, so that W x + B A x keeps W's layout: for a column-parallel W, A replicated
    (its input is the replicated x; its gradient is already the full one, reduced by B's column-parallel input) and
    B column-parallel (the update is this rank's output slice); for a row-parallel W, A row-parallel (its partial
    r-dim sums reduced, under sequence parallelism reduce-scattered, as W's output is) and B replicated on that
    reduced tensor (on sequence shards its gradient summed over tp, as the norms' is)."""
    styles: dict[str, ParallelStyle] = {f"{name}.base_layer": _projection_style(style, sp)}
    for adapter in module.lora_A:
        if style == "colwise":
            styles[f"{name}.lora_A.{adapter}"] = _LocalForward()
            styles[f"{name}.lora_B.{adapter}"] = ColwiseParallel()
        else:
            styles[f"{name}.lora_A.{adapter}"] = _projection_style("rowwise", sp)
            styles[f"{name}.lora_B.{adapter}"] = _LocalForward(reduce_grad=sp, sequence_input=sp,
                                                               output="shard" if sp else "local")
    return styles


def _module_styles(base: nn.Module, plan: dict[str, str], sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Module name (in the backbone) -> the torch parallel style applied to it."""
    styles: dict[str, ParallelStyle] = {}
    sp = sequence_parallel
    for name, style in tensor_parallel_plan(base, plan).items():
        if style == "replicated_with_grad_allreduce":
            styles[name] = _LocalForward(reduce_grad=True)
        elif style in ("colwise", "rowwise"):
            module = base.get_submodule(name)
            styles.update(_lora_styles(name, module, style, sp) if _is_lora(module) else
                          {name: _projection_style(style, sp)})
    styles.update(_experts_styles(base, plan))
    embed_out = Shard(1) if sp else Replicate()
    styles["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=embed_out,
                                             use_local_output=not sp)
    for name, _ in base.named_modules():
        if _NORM.match(name) and name not in styles:
            output = "gather" if name == "norm" else "shard"
            styles[name] = _LocalForward(reduce_grad=sp, sequence_input=sp, output=output if sp else "local")
        if sp and re.fullmatch(r"layers\.\d+\.self_attn", name):
            styles[name] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                              desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                              use_local_output=True)
        if sp and re.fullmatch(r"layers\.\d+\.mlp", name):
            styles[name] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                              use_local_output=True)
    return styles


def _moe_outputs(base: nn.Module) -> dict[str, ParallelStyle]:
    """Under sequence parallelism, a MoE block returns the full (summed) sequence: kept as sequence shards."""
    return {name: PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),),
                                      use_local_output=False)
            for name, module in base.named_modules()
            if re.fullmatch(r"layers\.\d+\.mlp", name) and hasattr(module, "experts")}


def _replicate_rest(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every module still holding plain parameters (routers, ...) gets them replicated, used locally."""
    for module in list(model.modules()):
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            parallelize_module(module, mesh, _LocalForward())


def _grads_in_param_placements(model: nn.Module) -> None:
    """A gradient arrives in the placement its op's sharding rule gives: the vocab-parallel embedding's is
    Replicate (the whole table). Each is put in its parameter's placement before it accumulates (Replicate ->
    Shard is a local slice), so a rank keeps only its shard of every gradient, as of every parameter."""
    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            placements = param.placements
            param.register_hook(lambda grad, placements=placements: grad if not isinstance(grad, DTensor)
                                or grad.placements == placements else grad.redistribute(placements=placements))


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True) -> nn.Module:
    """Shard `model` (a transformers causal LM, or a PEFT model around one) over the 1-D `tp_mesh`, in place, and
    return it. Checked first (``check_tensor_parallel``); the parameters must be materialised (not ``meta``).

    Args:
        model: the model; its ``config.base_model_tp_plan`` names the column- and row-parallel projections.
        tp_mesh: the 1-D ``tp`` mesh (a sub-mesh of a larger one is fine: ``world_mesh["tp"]``).
        sequence_parallel: keep the residual stream and its norms on sequence shards between layers.
    """
    hf_model = unwrap_hf_model(model)
    plan = check_tensor_parallel(hf_model, tp_mesh.size())
    base = hf_model.base_model
    styles = _module_styles(base, plan, sequence_parallel)
    parallelize_module(base, tp_mesh, styles)
    if sequence_parallel:
        parallelize_module(base, tp_mesh, _moe_outputs(base))
    head = hf_model.get_output_embeddings()
    if head is not None:  # HF's class plan: colwise_gather_output
        parallelize_module(head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
    _replicate_rest(hf_model, tp_mesh)
    _grads_in_param_placements(hf_model)
    hf_model._mindspeed_tp_mesh = tp_mesh
    return model
