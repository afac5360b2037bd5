"""Fused linear + cross-entropy: the causal-LM loss without ever holding the [tokens, vocab] logits.

Semantics are HF's `ForCausalLMLoss` exactly: logits upcast to fp32, labels shifted by one (or `shift_labels`
taken as given, as context parallel collators pass them), `ignore_index` rows ignored, and with
`num_items_in_batch` the summed loss divided by it (so gradient accumulation matches one large batch), else the
mean over valid tokens. Gemma2/3 final-logit softcapping (`tanh(z / cap) * cap`, in the logits dtype as HF does)
is applied when asked.

Only rows with a valid target are projected (an ignored row adds nothing to the loss or to any gradient), in
chunks of `chunk_size` rows, so at most one [chunk, vocab] block lives at a time. One exception, on the torch path
(the CPU reference) with the default chunk size: a forward whose logits hold at most SMALL_BLOCK_ELEMENTS (4 MiB
in fp32) is computed as one block with autograd's own linear and cross-entropy, in HF's arithmetic. Four paths,
chosen from what `lm_head_or_weight` is:
- a plain `nn.Linear` (or a weight tensor) with a local weight: `_ChunkedLinearCE`, an autograd Function that
  computes the gradients of hidden and weight chunk by chunk inside the forward (weight grad accumulated in
  fp32), so the backward only scales them;
- a tensor-parallel (vocab-parallel) `nn.Linear`, its weight a DTensor `Shard(0)` on the tp mesh, no softcapping:
  each rank scores its own vocabulary slice, [chunk, vocab / tp] logits never gathered (ops/vocab_parallel.py);
- any other module (PEFT LoRA on lm_head, `modules_to_save` wrappers, an FSDP2 module whose weight is a sharded
  DTensor, a DeepSpeed ZeRO-3 Linear, partitioned or gathered at the moment): the module
  itself is called on each chunk under `torch.utils.checkpoint`, so its adapters take part and get gradients
  and its hooks (FSDP unshard, ZeRO-3 gather) run, while the chunk's logits are recomputed in the
  backward instead of kept;
- a bare empty (ZeRO-3) weight TENSOR without gradient (eval): gathered with `deepspeed.zero.GatheredParameters`
  around the same Function; with a gradient it is refused with a clear error (see `_resolve_head`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..device import import_torch_npu
from . import vocab_parallel
from .registry import register, run

OP = "fused_linear_cross_entropy"

# Default chunk: rows such that one fp32 [rows, vocab] block holds a fixed number of elements. Measured on CPU
# (2 shared cores, fp32, vocab 151936, hidden 256, 2 x 1024 tokens): a loss-only sweep in one process took
# 6.8 / 7.2 / 6.6 / 6.4 s for forward+backward at 128 / 256 / 512 / 1024 rows (best of 3; plain HF 7.6 s), the three
# lm_head matmuls alone 4.0 / 3.6 / 3.3 / 4.4 s; benchmarks/bench_fused_loss.py --sweep measured whole training
# steps peaking at 2.31 / 2.33 / 2.46 / 3.09 GB RSS (plain HF 6.66 GB). Time is flat within the noise from 256 to
# 1024 rows while the peak grows by ~0.6 GB from 512 to 1024, so the block is 512 rows of a 150k vocabulary
# (~78M elements, 311 MB in fp32); small vocabularies get proportionally more rows (capped).
_DEFAULT_BLOCK_ELEMENTS = 512 * 151936
_MIN_ROWS, _MAX_ROWS = 64, 8192
# On the CPU, a local weight's loss takes at most 512 rows a chunk: at vocabulary 32,000 (hidden 256, 1,024 tokens, one
# thread, forward + backward against HF's loss) one block of all 1,024 rows took 0.60x of HF's time, 512-row blocks
# (64 MB) 0.57x, 256 0.53x; at 151,936, 256 rows took 0.71x against 512's 0.64x. Each chunk reads and writes the whole
# [V, H] weight gradient once: on a CPU that costs about 1% of the chunk's matmuls at 512 rows, where smaller blocks
# stay in cache; on a device it would cost far more of them, and a module's head (FSDP, ZeRO-3, PEFT) is called
# once per chunk: both keep the budget above.
_CPU_MAX_ROWS = 512


# The torch path (the CPU reference) with the default chunk size computes a forward whose logits hold at most
# this many elements (4 MiB in fp32) as one block with autograd's own ops: on the tiny models of the tests and
# examples the chunked Function's fixed cost was 5% of a training step (Llama, hidden 64, 256 tokens, vocabulary
# 128: 6.13 against 5.82 ms), and no more than this block's memory is at stake. The device backends always chunk.
SMALL_BLOCK_ELEMENTS = 1 << 20


def default_chunk_size(vocab_size: int, cpu_weight: bool = False) -> int:
    """Rows per chunk when `chunk_size=0`: a fixed logits-block budget, at most 512 rows for a local weight on the
    CPU (`cpu_weight`; see the measurements above)."""
    rows = _DEFAULT_BLOCK_ELEMENTS // max(int(vocab_size), 1)
    return int(min(max(rows, _MIN_ROWS), _CPU_MAX_ROWS if cpu_weight else _MAX_ROWS))


# ---------------------------------------------------------------------------------------------- chunk kernels
# A chunk kernel takes fp32 logits [c, V] (which it may overwrite) and targets [c] (all valid) and returns
# (sum of the c losses as an fp32 scalar, d(sum)/d(logits) [c, V] fp32 multiplied by `scale`).


@register(OP, "torch", name="torch")
def chunk_cross_entropy_torch(
    logits: torch.Tensor, target: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax - onehot computed in place in the logits buffer (one [c, V] block, no extra copies)."""
    rows = torch.arange(target.numel(), device=target.device)
    target_logit = logits[rows, target]
    row_max = logits.amax(dim=-1, keepdim=True)
    probs = logits.sub_(row_max).exp_()  # exp(z - max): the same max-shifted form log_softmax uses
    denom = probs.sum(dim=-1, keepdim=True)
    loss_sum = (row_max.squeeze(-1) + denom.log().squeeze(-1) - target_logit).sum()
    grad = probs.mul_(scale / denom)  # scale folded into the softmax division: one pass over the block
    grad[rows, target] -= scale
    return loss_sum, grad


@register(OP, "npu", name="npu:npu_cross_entropy_loss")
def chunk_cross_entropy_npu(
    logits: torch.Tensor, target: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu's fused CE on one chunk. The logits are fp32 here, so the loss it returns (in the logits dtype)
    is fp32 too; the chunk is far below the op's 200,000-row limit, and only default arguments besides the
    reduction are used. The gradient is rebuilt from the log-probabilities it returns."""
    torch_npu = import_torch_npu()
    loss, log_prob, _, _ = torch_npu.npu_cross_entropy_loss(logits, target, reduction="sum")
    if log_prob.shape != logits.shape:  # not the documented [N, C] block: keep the exact torch math
        return chunk_cross_entropy_torch(logits, target, scale)
    rows = torch.arange(target.numel(), device=target.device)
    grad = log_prob.float().exp_().mul_(scale)
    grad[rows, target] -= scale
    return loss.float().reshape(()), grad


# ------------------------------------------------------------------------------------- local-weight Function
def _chunk_step(h, t, weight, bias, softcap, kernel, inv_divisor, want_grad, grad_h, grad_w, grad_b) -> torch.Tensor:
    """One chunk of `_ChunkedLinearCE`: its loss sum, with its gradients written into grad_h (this chunk's rows)
    and accumulated into grad_w / grad_b."""
    z = F.linear(h, weight, bias)  # model dtype, like HF's lm_head
    tanh = None
    if softcap is not None:
        tanh = z.div_(softcap).tanh_()  # in the logits dtype, as HF's forward does it
        z = tanh * softcap
    chunk_loss, g = kernel(z.float(), t, inv_divisor)  # .float(): no copy for fp32
    if not want_grad:
        return chunk_loss
    if tanh is not None:  # d(cap * tanh(z / cap))/dz = 1 - tanh^2
        g.mul_(tanh.float().square_().neg_().add_(1.0))
    g = g.to(h.dtype)
    if grad_h is not None:
        torch.mm(g, weight, out=grad_h)
    if grad_w is not None:
        if g.dtype == torch.float32:
            grad_w.addmm_(g.t(), h)
        else:
            grad_w += torch.mm(g.t(), h).float()
    if grad_b is not None:
        grad_b += g.float().sum(0)
    return chunk_loss


class _ChunkedLinearCE(torch.autograd.Function):
    """loss_sum / divisor for rows `hidden` [n, H] (all targets valid) with grads computed in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, divisor, softcap, chunk_size, kernel, grad_enabled):
        # needs_input_grad ignores no_grad(): the caller's grad mode comes in as `grad_enabled`
        need_h, need_w, need_b = (grad_enabled and ctx.needs_input_grad[i] for i in range(3))
        want_grad = need_h or need_w or need_b
        # 0 items: the loss is 0/0 = nan as in HF, while every gradient stays 0 (no row contributes), as in HF
        inv_divisor = 1.0 / divisor if divisor != 0 else 0.0
        n = hidden.shape[0]
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        # fp32 accumulation over chunks; an fp32 weight accumulates in place with addmm_ (no temporary)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_size):
            # one function call per chunk: its [chunk, vocab] block is freed before the next one is made
            loss_sum += _chunk_step(hidden[start : start + chunk_size], target[start : start + chunk_size], weight,
                                    bias, softcap, kernel, inv_divisor, want_grad,
                                    None if grad_h is None else grad_h[start : start + chunk_size], grad_w, grad_b)
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss_sum / divisor

    @staticmethod
    def backward(ctx, grad_out):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError("fused_linear_cross_entropy: backward ran twice (its gradients are consumed once)")
        ctx.grads = None
        # Trainer's plain loss.backward() gives exactly 1: hand the buffers over without another [V, H] pass
        unit = grad_out.numel() == 1 and float(grad_out) == 1.0
        out = []
        for grad, dtype in zip(grads, ctx.dtypes):
            if grad is not None:
                grad = grad if unit else grad * grad_out.to(grad.dtype)
                grad = grad.to(dtype)
            out.append(grad)
        return out[0], out[1], out[2], None, None, None, None, None, None


# ------------------------------------------------------------------------------------------ module path
def _module_chunk_loss(module: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, t: torch.Tensor,
                       softcap: float | None, ignore_index: int = -100, reduction: str = "sum") -> torch.Tensor:
    """Cross-entropy of rows `h` through `module` (the head, or F.linear bound to its weight) with autograd's ops."""
    logits = module(h)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), t, ignore_index=ignore_index, reduction=reduction)


def _agreed_chunk_count(n_chunks: int, device: torch.device) -> int:
    """The largest chunk count over all ranks. A distributed lm_head (FSDP unshard / reduce-scatter, ZeRO-3
    gather) runs collectives on every call, and ranks hold different numbers of valid rows: every rank must call
    it equally often (as HF's single call does), or the collectives mismatch and the job hangs."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return n_chunks
    count = torch.tensor([n_chunks], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def _module_loss_sum(
    module: nn.Module, hidden: torch.Tensor, target: torch.Tensor, softcap: float | None, chunk_size: int
) -> torch.Tensor:
    """Sum of losses calling `module` per chunk (at least once, and as often as on every other rank: the extra
    calls get zero rows); each chunk's logits are recomputed in the backward."""
    total = None
    n_chunks = _agreed_chunk_count(max(1, -(-hidden.shape[0] // chunk_size)), hidden.device)
    for index in range(n_chunks):
        start = index * chunk_size
        h, t = hidden[start : start + chunk_size], target[start : start + chunk_size]
        if torch.is_grad_enabled():
            # preserve_rng_state (default) replays LoRA dropout identically in the recomputation
            part = checkpoint(_module_chunk_loss, module, h, t, softcap, use_reentrant=False)
        else:
            part = _module_chunk_loss(module, h, t, softcap)
        total = part if total is None else total + part
    return total


# ------------------------------------------------------------------------------------------ path selection
def _is_dtensor(t: torch.Tensor | None) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def _empty_weight_error(detail: str) -> RuntimeError:
    return RuntimeError(
        f"fused_linear_cross_entropy: the lm_head weight is empty (numel 0) {detail}; pass the lm_head module of "
        "a materialised or DeepSpeed-ZeRO-3-hooked model, or turn the fused loss off "
        "(kernels.fused_linear_cross_entropy: false)."
    )


def _zero3_gather(params: list[torch.Tensor]) -> contextlib.AbstractContextManager:
    """Gather ZeRO-3 partitioned (numel 0) params for a loss that needs no gradient."""
    if not all(hasattr(p, "ds_id") for p in params):
        raise _empty_weight_error("and is not a DeepSpeed ZeRO-3 parameter")
    try:
        deepspeed = importlib.import_module("deepspeed")
    except ImportError as err:
        raise _empty_weight_error("(DeepSpeed ZeRO-3 partitioned) and deepspeed cannot be imported") from err
    # modifier_rank=None: a read-only gather on every rank
    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _resolve_head(head: nn.Module | torch.Tensor):
    """("linear", weight, bias) for a local weight, ("zero3", weight, bias) for a partitioned weight tensor that
    needs no gradient, or ("module", module) for anything that has to be called.

    A ZeRO-3 weight gathered around the loss cannot take a gradient: it is partitioned again (numel 0) by the
    time autograd accumulates into it, and autograd rejects a [V, H] gradient for a [0] parameter (checked with
    torch 2.13). So a ZeRO-3 lm_head MODULE is called per chunk instead, where DeepSpeed's own module hooks
    gather it for the forward, the recomputation and the backward, as they do for HF's plain forward.
    """
    if isinstance(head, torch.Tensor):
        if _is_dtensor(head):
            raise TypeError(
                "fused_linear_cross_entropy: got a sharded DTensor weight; pass the lm_head MODULE instead, so "
                "that its FSDP/TP hooks gather it and reduce its gradient the way the parallel plan expects."
            )
        if head.numel() == 0:
            if head.requires_grad and torch.is_grad_enabled():
                raise _empty_weight_error("and needs a gradient, which a gathered copy cannot receive")
            return ("zero3", head, None)
        return ("linear", head, None)
    if isinstance(head, nn.Linear):
        weight, bias = head.weight, head.bias
        if hasattr(weight, "ds_id"):
            # ZeRO-3, partitioned or gathered right now (prefetched, or never released because its module is not
            # called): called as a module, so ZeRO's hooks gather it per chunk and release it after
            return ("module", head)
        if weight.numel() == 0:
            raise _empty_weight_error("and is not a DeepSpeed ZeRO-3 parameter")
        if not _is_dtensor(weight) and weight.device.type != "meta" and _plain_weight(head):
            return ("linear", weight, bias)
    return ("module", head)


def _plain_weight(head: nn.Linear) -> bool:
    """Whether F.linear can use the head's weight as it is: not a quantized one (a bitsandbytes Linear4bit, an
    nn.Linear subclass, holds a packed [n, 1] uint8 / quant-storage Params4bit there; Linear8bitLt an int8 one),
    which has to be called as a module."""
    weight = head.weight
    return weight.is_floating_point() and tuple(weight.shape) == (head.out_features, head.in_features)


def _out_features(module: nn.Module) -> int:
    """Vocabulary size of an output-projection module (looking through PEFT/FSDP wrappers)."""
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    for candidate in (module, base, getattr(module, "original_module", None)):
        size = getattr(candidate, "out_features", None)
        if size:
            return int(size)
    weight = getattr(module, "weight", None)
    if weight is not None and weight.dim() == 2 and weight.shape[0]:
        return int(weight.shape[0])
    return 0  # unknown: default_chunk_size(0) then gives its largest chunk


def _targets(labels, shift_labels, ignore_index, rows: int, device) -> torch.Tensor:
    if shift_labels is None:
        if labels is None:
            raise ValueError("fused_linear_cross_entropy needs labels or shift_labels")
        # HF: pad with ignore_index then drop the first label, so position i predicts token i + 1
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(device)
    if target.numel() != rows:
        raise ValueError(f"fused_linear_cross_entropy: {rows} hidden rows but {target.numel()} (shifted) labels")
    return target


def _one_block_loss(flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                    ignore_index: int, num_items_in_batch: torch.Tensor | int | None,
                    softcap: float | None) -> torch.Tensor:
    """The loss of a small forward in one block with autograd's own ops, in HF's arithmetic: the mean over valid
    rows, or their sum divided by `num_items_in_batch`."""
    project = functools.partial(F.linear, weight=weight, bias=bias)
    if num_items_in_batch is None:
        return _module_chunk_loss(project, flat, target, softcap, ignore_index, reduction="mean")
    total = _module_chunk_loss(project, flat, target, softcap, ignore_index)
    return total / (num_items_in_batch.to(total.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    lm_head_or_weight: nn.Module | torch.Tensor,
    labels: torch.Tensor | None,
    *,
    shift_labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    softcap: float | None = None,
    chunk_size: int = 0,
) -> torch.Tensor:
    """HF `ForCausalLMLoss(lm_head(hidden), labels, ...)` computed chunk by chunk; returns an fp32 scalar.

    Args:
        hidden: final hidden states [..., H] (e.g. [B, S, H]), after any `logits_to_keep` slicing.
        lm_head_or_weight: the output-projection module (nn.Linear, PEFT LoRA Linear, FSDP2 module, ...) or its
            [V, H] weight tensor.
        labels: unshifted labels with the leading shape of `hidden`; shifted here as HF does.
        shift_labels: already-shifted labels (context-parallel collators); used instead of `labels`.
        ignore_index: label value that contributes nothing.
        num_items_in_batch: if given, sum of losses divided by it (Trainer's gradient-accumulation scaling);
            else the mean over valid tokens (nan when there are none, as in HF).
        softcap: final-logit softcapping value (Gemma2/3 `final_logit_softcapping`), or None.
        chunk_size: rows per chunk; 0 picks `default_chunk_size(vocab)`.
    """
    hdim = hidden.shape[-1]
    flat = hidden.reshape(-1, hdim)
    target = _targets(labels, shift_labels, ignore_index, flat.shape[0], flat.device)
    softcap = None if not softcap else float(softcap)
    path = _resolve_head(lm_head_or_weight)
    kernel: Callable = run(OP, flat.device)  # counted once per loss, whichever path computes it
    if path[0] == "linear" and not chunk_size and kernel is chunk_cross_entropy_torch \
            and flat.shape[0] * path[1].shape[0] <= SMALL_BLOCK_ELEMENTS:
        return _one_block_loss(flat, path[1], path[2], target, ignore_index, num_items_in_batch, softcap)
    # Project only the rows that count; the index backward scatters their grads into a zero [N, H] gradient
    valid = (target != ignore_index).nonzero().squeeze(1)
    n_valid = valid.numel()
    if n_valid != target.numel():
        flat, target = flat.index_select(0, valid), target.index_select(0, valid)
    if num_items_in_batch is None:
        divisor = float(n_valid)
    else:
        divisor = float(num_items_in_batch.item() if torch.is_tensor(num_items_in_batch) else num_items_in_batch)

    if path[0] == "module":
        module = path[1]
        rows = chunk_size or default_chunk_size(_out_features(module))
        if softcap is None and vocab_parallel.is_vocab_parallel_head(module):  # tp: logits stay vocab slices
            total = run(vocab_parallel.OP, flat.device)(flat, module, target, rows)
        else:
            total = _module_loss_sum(module, flat, target, softcap, rows).float()
        if n_valid == 0:  # the module ran on zero rows: HF's 0 (or 0/0 = nan) with zero gradients
            return total + (float("nan") if divisor == 0 else 0.0)
        return total / divisor

    kind, weight, bias = path
    params = [p for p in (weight, bias) if p is not None]
    with _zero3_gather(params) if kind == "zero3" else contextlib.nullcontext():
        rows = chunk_size or default_chunk_size(weight.shape[0], cpu_weight=weight.device.type == "cpu")
        return _ChunkedLinearCE.apply(
            flat, weight, bias, target, divisor, softcap, rows, kernel, torch.is_grad_enabled()
        )


def implementation_name(device: torch.device | str) -> str:
    """The chunk kernel `fused_linear_cross_entropy` runs on `device` (for report())."""
    from .registry import implementation

    return implementation(OP, device)
