"""Grouped-GEMM experts: the MLP of every routed expert over tokens already grouped by expert.

`grouped_mlp` is the contract the experts kernel and expert parallelism share: rows of `x` are sorted by expert
(the first counts[0] rows go to expert 0, the next counts[1] to expert 1, ...), each group runs
down(gate(gate_up(x))) with its own expert's weights (HF's fused 3-D layout: gate_up [E, 2I, H], down [E, H, I]),
and the output keeps the input's row order. Routing weights are not applied here: `permute` groups a batch's
tokens by expert and `unpermute` brings them back, weighted (expert parallelism sends the groups between them).

Each of the three runs the backend of the tensors' device (ops/registry.py):
- npu: `npu_moe_token_permute` -> `npu_grouped_matmul` (gate_up) -> `npu_swiglu` -> `npu_grouped_matmul` (down) ->
  `npu_moe_token_unpermute` (the default gate is ops.swiglu's packed swiglu: `npu_swiglu` on this backend). The
  grouped matmul has no autograd on the device: `_NpuGroupedMatmul` runs its backward with the same op (dX:
  group_type=0 over the transposed weights; dW: group_type=2, split_item=3).
- torch (CPU and CUDA): `torch._grouped_mm` (exact against the per-expert loop in fp32) where its limits allow
  (16-byte aligned strides and pointers, CUDA compute capability >= 8.0), else the per-expert loop. Its
  backward gets a materialised gradient (it rejects an expanded stride-0 one), and no row lies past the last
  offset (the groups always cover every row), so no uninitialised rows reach a result.

One host read per MoE block in eager mode (the group sizes, to slice off HF's expert-parallel sentinel rows and to
check the groups). While torch.compile traces, none on the torch backend (`_experts_mlp_traced`): a new routing is
not a new graph. The per-expert loop (where torch._grouped_mm does not apply) and the npu backend keep it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..device import import_torch_npu
from .registry import register, resolve_backend, run
from .swiglu import swiglu_packed

Gate = Callable[[torch.Tensor], torch.Tensor]


def _counts_tensor(counts: Sequence[int] | torch.Tensor, x: torch.Tensor, experts: int) -> torch.Tensor:
    """`counts` as an int64 tensor on x's device, checked against the experts and rows (a host read of a tensor;
    not while torch.compile traces, where a device tensor is taken as it is)."""
    if isinstance(counts, torch.Tensor) and torch.compiler.is_compiling():
        return counts
    values = counts.tolist() if isinstance(counts, torch.Tensor) else [int(c) for c in counts]
    counts = torch.as_tensor(values, dtype=torch.int64, device=x.device)
    if counts.dim() != 1 or len(values) != experts or sum(values) != x.shape[0] or min(values, default=0) < 0:
        raise ValueError(f"grouped_mlp: counts {values} do not match {experts} experts and {x.shape[0]} rows")
    return counts


def _biased(out: torch.Tensor, bias: torch.Tensor | None, counts: torch.Tensor) -> torch.Tensor:
    """Each row plus its expert's bias [E, M] (None: unchanged)."""
    if bias is None:
        return out
    return out + bias.repeat_interleave(counts, dim=0, output_size=out.shape[0])


def grouped_mlp(x: torch.Tensor, counts: Sequence[int] | torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                apply_gate: Gate | None = None, *, gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None, transposed: bool = False) -> torch.Tensor:
    """Per-expert MLP over `x` [N, H] grouped by `counts` (E entries, summing to N); returns [N, H].

    `apply_gate` maps the [n, 2I] gate_up output to [n, I] (default: silu(first half) * second half, the backend's
    fused swiglu). Optional per-expert biases (gate_up_bias [E, 2I], down_bias [E, H]) are added after each
    projection; `transposed=True` takes the weights as [E, H, 2I] / [E, I, H] (GPT-OSS) instead of HF's usual
    [E, 2I, H] / [E, H, I].
    """
    counts = _counts_tensor(counts, x, gate_up.shape[0])
    weights = [w for w in (gate_up, down, gate_up_bias, down_bias) if w is not None]
    if x.shape[0] == 0:  # no tokens here: an empty result that still reaches the weights in backward
        width = down.shape[2] if transposed else down.shape[1]
        return x.new_zeros(0, width) + 0 * sum(w.sum() for w in weights)
    matmul = run("experts", x.device)
    up_kn, down_kn = (gate_up, down) if transposed else (gate_up.transpose(1, 2), down.transpose(1, 2))
    projected = _biased(matmul(x.to(gate_up.dtype), up_kn, counts), gate_up_bias, counts)
    hidden = (apply_gate or swiglu_packed)(projected)
    return _biased(matmul(hidden.contiguous(), down_kn, counts), down_bias, counts)


# ---- torch: torch._grouped_mm where it applies, else the per-expert loop -------------------------------------------


class _MaterialisedGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense gradient (torch._grouped_mm's backward rejects stride-0 ones)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return grad.contiguous()


def _aligned(t: torch.Tensor) -> bool:
    """torch._grouped_mm's layout rule: a 16-byte aligned pointer and every non-unit stride a multiple of 16 bytes."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s == 1 or (s * size) % 16 == 0 for s in t.stride())


def grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._grouped_mm can run x [N, K] @ weight [E, K, M] here (else the per-expert loop runs)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if x.dtype != weight.dtype or x.device != weight.device or x.device.type not in ("cpu", "cuda"):
        return False
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    # a traced tensor has no address: the compiled graph's own kernels place their buffers
    return torch.compiler.is_compiling() or (_aligned(x) and _aligned(weight))


@register("experts", "torch", name="torch:grouped_mm")
def grouped_matmul_torch(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [N, K] grouped by counts, times each group's weight [E, K, M]: [N, M]. While torch.compile traces, one
    opaque op (`mindspeed_hf::grouped_matmul`: torch._grouped_mm's fake kernel takes only bf16, and the loop needs the
    group sizes on the host)."""
    if torch.compiler.is_compiling():
        return traced_grouped_matmul()(x, weight, counts)
    if grouped_mm_applies(x, weight):
        offsets = counts.cumsum(0, dtype=torch.int32)
        return _MaterialisedGrad.apply(torch._grouped_mm(x, weight, offs=offsets))
    groups = [rows @ weight[e] for e, rows in enumerate(x.split(counts.tolist())) if rows.shape[0]]
    return torch.cat(groups)


_traced: dict[str, Callable] = {}  # "grouped_matmul": the op a compiled graph runs (define_traced_op)


def traced_grouped_matmul() -> Callable:
    """`mindspeed_hf::grouped_matmul` (grouped_matmul_torch's eager body as one opaque op, with its autograd), defined
    on first need: registering the two ops costs ~30 ms of host time, which a dense model's run does not pay. The
    patch of a MoE family defines it before any model is built (define_traced_op), so a trace finds it ready."""
    return _traced.get("grouped_matmul") or define_traced_op()


@torch.compiler.disable  # registering ops is not traced: reached in a trace only if no MoE family was patched
def define_traced_op() -> Callable:
    """Define (once) and return `mindspeed_hf::grouped_matmul`, the op grouped_matmul_torch runs while traced."""
    if "grouped_matmul" in _traced:
        return _traced["grouped_matmul"]

    @torch.library.custom_op("mindspeed_hf::grouped_matmul", mutates_args=())
    def grouped_matmul_op(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """grouped_matmul_torch's eager body, as one op for a compiled graph (its autograd below)."""
        with torch.no_grad():
            return grouped_matmul_torch(x, weight, counts).clone()

    @grouped_matmul_op.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:  # noqa: ARG001
        return x.new_empty(x.shape[0], weight.shape[2])

    @torch.library.custom_op("mindspeed_hf::grouped_matmul_weight_grad", mutates_args=())
    def weight_grad(x: torch.Tensor, grad: torch.Tensor, counts: torch.Tensor, experts: int) -> torch.Tensor:
        """d(weight) [E, K, M] of x [N, K] @ weight grouped by counts, from grad [N, M] (zero for an empty group)."""
        out = x.new_zeros(experts, x.shape[1], grad.shape[1])
        for e, (rows, g) in enumerate(zip(x.split(counts.tolist()), grad.split(counts.tolist()))):
            if rows.shape[0]:
                out[e] = rows.t() @ g
        return out

    @weight_grad.register_fake
    def _(x: torch.Tensor, grad: torch.Tensor, counts: torch.Tensor, experts: int) -> torch.Tensor:  # noqa: ARG001
        return x.new_empty(experts, x.shape[1], grad.shape[1])

    def setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:  # noqa: ARG001
        x, weight, counts = inputs
        ctx.save_for_backward(x, weight, counts)

    def backward(ctx: Any, grad: torch.Tensor):
        x, weight, counts = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grouped_matmul_op(grad, weight.transpose(1, 2), counts) if ctx.needs_input_grad[0] else None
        grad_w = weight_grad(x, grad, counts, weight.shape[0]) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None

    grouped_matmul_op.register_autograd(backward, setup_context=setup)
    _traced["grouped_matmul"] = grouped_matmul_op
    return grouped_matmul_op


# ---- npu: npu_grouped_matmul, forward and backward ------------------------------------------------------------------


class _NpuGroupedMatmul(torch.autograd.Function):
    """y [N, M] = x [N, K] grouped by `counts` times weight [E, K, M] per group, forward and backward on
    npu_grouped_matmul (group_list_type=1: per-group counts)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, counts)
        npu = import_torch_npu()
        return npu.npu_grouped_matmul([x], [weight], group_list=counts, split_item=2, group_type=0,
                                      group_list_type=1)[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, counts = ctx.saved_tensors
        npu = import_torch_npu()
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = npu.npu_grouped_matmul([grad], [weight.transpose(1, 2)], group_list=counts, split_item=2,
                                            group_type=0, group_list_type=1)[0]
        if ctx.needs_input_grad[1]:
            grad_w = npu.npu_grouped_matmul([x.t()], [grad], group_list=counts, split_item=3, group_type=2,
                                            group_list_type=1)[0]
            # an expert without rows gets an exact zero, whatever the K-axis kernel leaves in its block
            grad_w = grad_w.masked_fill((counts == 0).view(-1, 1, 1), 0)
        return grad_x, grad_w, None


@register("experts", "npu", name="npu:npu_grouped_matmul")
def grouped_matmul_npu(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return _NpuGroupedMatmul.apply(x, weight, counts)


# ---- token grouping ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Routing:
    """Where each (token, top-k slot) went: `order[i]` is the flat [T * k] index of sorted row i.

    `sorted_indices` is its inverse as npu_moe_token_permute returns it (int32, slot -> row), when that op made the
    grouping; None otherwise."""

    order: torch.Tensor  # int64 [T * k]
    counts: torch.Tensor  # int64 [E]: rows per expert, in expert order
    num_tokens: int
    top_k: int
    sorted_indices: torch.Tensor | None = None


def _inverse(order: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def _group_sizes(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert id, int64 [num_experts]. While torch.compile traces: a scatter-add into a fixed-size buffer
    (bincount's output size depends on the data, a graph break wherever fullgraph is not asked for, as in
    transformers' default CompileConfig). In eager mode bincount, whose longer output shows ids past the experts
    (experts_mlp refuses them)."""
    if torch.compiler.is_compiling():
        ids = flat.long()
        return ids.new_zeros(num_experts).scatter_add_(0, ids, torch.ones_like(ids))
    return torch.bincount(flat, minlength=num_experts)


def permute(hidden: torch.Tensor, top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, Routing]:
    """Rows of `hidden` [T, H] repeated per top-k slot and grouped by expert (stable): ([T * k, H], Routing)."""
    flat = top_k_index.reshape(-1)
    counts = _group_sizes(flat, num_experts)
    if resolve_backend(hidden.device) == "npu" and hidden.shape[0]:
        rows, sorted_indices = import_torch_npu().npu_moe_token_permute(hidden, top_k_index)
        routing = Routing(_inverse(sorted_indices.long()), counts, hidden.shape[0], top_k_index.shape[-1],
                          sorted_indices)
        return rows, routing
    order = torch.argsort(flat, stable=True)
    routing = Routing(order, counts, hidden.shape[0], top_k_index.shape[-1])
    return hidden.index_select(0, order // routing.top_k), routing


def unpermute(rows: torch.Tensor, routing: Routing, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Inverse of `permute`: each token's k expert outputs weighted by `top_k_weights` [T, k] and summed, in fp32;
    returns [T, H] in the rows' dtype."""
    weights_fit = top_k_weights.dtype == rows.dtype or rows.dtype == torch.float32
    if resolve_backend(rows.device) == "npu" and routing.num_tokens and weights_fit:
        # bf16 rows with fp32 weights stay on torch: the device op's gradient is NaN for that mix
        sorted_indices = routing.sorted_indices
        if sorted_indices is None:
            sorted_indices = _inverse(routing.order).to(torch.int32)
        probs = top_k_weights.reshape(routing.num_tokens, -1).to(rows.dtype)  # exact: same dtype, or up to fp32
        return import_torch_npu().npu_moe_token_unpermute(rows, sorted_indices, probs)
    per_slot = torch.empty_like(rows).index_copy(0, routing.order, rows)
    per_slot = per_slot.view(routing.num_tokens, routing.top_k, -1)
    out = (per_slot.float() * top_k_weights.float().unsqueeze(-1)).sum(dim=1)
    return out.to(rows.dtype)


def experts_mlp(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, apply_gate: Gate | None = None, **layout: Any) -> torch.Tensor:
    """The routed experts of one MoE block: permute -> grouped_mlp -> unpermute. `hidden` [T, H], `top_k_index` /
    `top_k_weights` [T, k]; ids >= E (HF's expert-parallel "not here" sentinel) contribute nothing; `layout`: the
    biases / transposed keywords of grouped_mlp. [T, H]."""
    experts = gate_up.shape[0]
    rows, routing = permute(hidden, top_k_index, experts + 1)
    if torch.compiler.is_compiling() and resolve_backend(hidden.device) == "torch":
        return _experts_mlp_traced(rows, routing, top_k_weights, gate_up, down, apply_gate, layout)
    counts = routing.counts.tolist()  # the one host read of the block
    if len(counts) > experts + 1:
        raise ValueError(f"experts_mlp: expert ids up to {len(counts) - 1}, but only {experts} experts")
    kept = sum(counts[:experts])
    out = grouped_mlp(rows[:kept], counts[:experts], gate_up, down, apply_gate, **layout)
    if kept < rows.shape[0]:
        out = torch.cat([out, out.new_zeros(rows.shape[0] - kept, out.shape[1])])
    return unpermute(out, routing, top_k_weights)  # (unpermute does not read the counts)


def _experts_mlp_traced(rows: torch.Tensor, routing: Routing, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
                        down: torch.Tensor, apply_gate: Gate | None, layout: dict[str, Any]) -> torch.Tensor:
    """experts_mlp while torch.compile traces, with no host read: the groups stay a device tensor (the grouped
    matmul takes them as offsets), and the rows of HF's "not here" sentinel (sorted last) are zeroed and computed
    with the last expert, then dropped, instead of sliced off by a count read to the host. Same result: every kept row
    runs its own expert, a dropped row contributes nothing and gets no gradient."""
    experts = gate_up.shape[0]
    counts = routing.counts[:experts].clone()
    counts[-1] += routing.counts[experts]  # the groups cover every row
    kept = (torch.arange(rows.shape[0], device=rows.device) < routing.counts[:experts].sum()).unsqueeze(-1)
    out = grouped_mlp(torch.where(kept, rows, 0), counts, gate_up, down, apply_gate, **layout)
    return unpermute(torch.where(kept, out, 0), routing, top_k_weights)
