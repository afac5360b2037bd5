"""MoE routing ops: npu_moe_token_permute / npu_moe_token_unpermute (differentiable), and the inference-only
npu_moe_gating_top_k_softmax and npu_moe_init_routing (no autograd)."""

from __future__ import annotations

import torch

from . import _checks as C

MAX_TOPK = 1024
INDEX_DTYPES = (torch.int32, torch.int64)


def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    """(permuted_tokens, sorted_indices int32[T*topK]) with permuted[sorted_indices[i]] = tokens[i // topK].

    Tokens are grouped by expert id (stable in the flattened [T, topK] order); num_out_tokens keeps the first
    num_out_tokens sorted rows (None or 0: all; negative: Python slice semantics).
    """
    op = "npu_moe_token_permute"
    tokens = C.tensor(op, "tokens", tokens)
    indices = C.tensor(op, "indices", indices)
    if padded_mode:
        raise C.unsupported(op, "padded_mode=True")
    C.check(tokens.dim() == 2, op, f"tokens must be [T, H], got shape {list(tokens.shape)}")
    C.check(indices.dtype in INDEX_DTYPES, op, f"indices must be int32 or int64, got {indices.dtype}")
    C.check(indices.dim() in (1, 2), op, f"indices must be [T] or [T, topK], got shape {list(indices.shape)}")
    C.check(indices.shape[0] == tokens.shape[0], op, f"indices has {indices.shape[0]} rows, tokens {tokens.shape[0]}")
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    C.check(1 <= topk <= MAX_TOPK, op, f"topK must be in 1..{MAX_TOPK}, got {topk}")
    total = indices.numel()
    keep = total if num_out_tokens is None else C.integer(op, "num_out_tokens", num_out_tokens)
    keep = total if keep == 0 else len(range(total)[:keep])
    order = torch.argsort(indices.reshape(-1), stable=True)
    sorted_indices = torch.argsort(order).to(torch.int32)
    permuted = tokens.index_select(0, order[:keep] // topk)
    return permuted, sorted_indices


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    """out[t] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t * topK + k]] -> [T, H] (probs None: topK=1).

    Rows dropped by num_out_tokens (index >= permuted_tokens rows) contribute zero. Differentiable.
    """
    op = "npu_moe_token_unpermute"
    permuted = C.float_tensor(op, "permuted_tokens", permuted_tokens)
    sorted_indices = C.tensor(op, "sorted_indices", sorted_indices)
    if padded_mode:
        raise C.unsupported(op, "padded_mode=True")
    C.check(permuted.dim() == 2, op, f"permuted_tokens must be 2-D, got shape {list(permuted.shape)}")
    C.check(sorted_indices.dtype == torch.int32, op, f"sorted_indices must be int32, got {sorted_indices.dtype}")
    C.check(sorted_indices.dim() == 1, op, "sorted_indices must be 1-D")
    total = sorted_indices.numel()
    if probs is None:
        topk = 1
    else:
        probs = C.float_tensor(op, "probs", probs)
        C.check(probs.dim() == 2 and probs.numel() == total, op, f"probs must be [T, topK] with T*topK={total}")
        topk = probs.shape[1]
    C.check(1 <= topk <= MAX_TOPK, op, f"topK must be in 1..{MAX_TOPK}, got {topk}")
    t, h = total // topk, permuted.shape[1]
    if restore_shape is not None:
        shape = C.int_list(op, "restore_shape", restore_shape)
        C.check(shape == [t, h], op, f"restore_shape {shape} must be the unpermuted shape {[t, h]}")
    idx = sorted_indices.long()
    C.check(total == 0 or (int(idx.min()) >= 0 and int(idx.max()) < total), op, "sorted_indices out of range")
    rows = permuted.shape[0]
    valid = (idx < rows).unsqueeze(1)
    gathered = permuted.float().index_select(0, idx.clamp(max=max(rows - 1, 0))) * valid
    gathered = gathered.view(t, topk, h)
    if probs is not None:
        gathered = gathered * probs.float().unsqueeze(-1)
    return gathered.sum(dim=1).to(permuted.dtype)


def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    """(y[..., k], expert_idx int32, row_idx int32): top-k of softmax(x) over experts; finished rows get
    expert_idx = E. row_idx[n, j] = j * N + n. Inference only: a backward through y raises."""
    op = "npu_moe_gating_top_k_softmax"
    x = C.float_tensor(op, "x", x)
    k = C.integer(op, "k", k)
    C.check(x.dim() in (2, 3), op, f"x must be 2-D or 3-D, got shape {list(x.shape)}")
    experts = x.shape[-1]
    C.check(1 <= k <= min(experts, MAX_TOPK), op, f"k must be in 1..{min(experts, MAX_TOPK)}, got {k}")
    with torch.no_grad():
        y, idx = torch.topk(torch.softmax(x.float(), dim=-1), k, dim=-1)
        idx = idx.to(torch.int32)
        if finished is not None:
            finished = C.tensor(op, "finished", finished)
            C.check(finished.dtype == torch.bool, op, f"finished must be bool, got {finished.dtype}")
            C.check(finished.shape == x.shape[:-1], op, f"finished must have shape {list(x.shape[:-1])}")
            idx = idx.masked_fill(finished.unsqueeze(-1), experts)
        rows = x.numel() // experts
        row_idx = torch.arange(rows * k, dtype=torch.int32, device=x.device).view(k, rows).t().reshape(idx.shape)
    return C.no_autograd(op, (y.to(x.dtype), idx, row_idx), (x,))


def npu_moe_init_routing(x, row_idx, expert_idx, active_num):
    """(expanded_x, expanded_row_idx int32, expanded_expert_idx int32): sort (expert_idx, row_idx) pairs by
    expert; expanded_row_idx[sorted_row_idx[i]] = i; expanded_x[i] = x[sorted_row_idx[i] % N] for the first
    min(N, active_num) * k rows. No autograd."""
    op = "npu_moe_init_routing"
    x = C.float_tensor(op, "x", x)
    row_idx = C.tensor(op, "row_idx", row_idx)
    expert_idx = C.tensor(op, "expert_idx", expert_idx)
    active_num = C.integer(op, "active_num", active_num)
    C.check(x.dim() == 2, op, f"x must be [N, H], got shape {list(x.shape)}")
    for name, t in (("row_idx", row_idx), ("expert_idx", expert_idx)):
        C.check(t.dtype == torch.int32, op, f"{name} must be int32, got {t.dtype}")
        C.check(t.dim() == 2 and t.shape[0] == x.shape[0], op, f"{name} must be [N={x.shape[0]}, k]")
    C.check(row_idx.shape == expert_idx.shape, op, "row_idx and expert_idx must have one shape")
    C.check(active_num >= 0, op, f"active_num must be >= 0, got {active_num}")
    n, k = expert_idx.shape
    flat_r, flat_e = row_idx.reshape(-1).long(), expert_idx.reshape(-1).long()
    perm = torch.arange(n * k, device=x.device)
    C.check(torch.equal(flat_r.sort().values, perm), op, "row_idx must be a permutation of 0..N*k-1")
    with torch.no_grad():
        by_row = torch.argsort(flat_r, stable=True)
        order = by_row[torch.argsort(flat_e[by_row], stable=True)]  # key: expert, ties: row_idx
        sorted_rows = flat_r[order]
        expanded_row_idx = torch.empty_like(sorted_rows)
        expanded_row_idx[sorted_rows] = perm
        expanded_x = x[sorted_rows[: min(n, active_num) * k] % n]
    outputs = (expanded_x, expanded_row_idx.to(torch.int32), flat_e[order].to(torch.int32))
    return C.no_autograd(op, outputs, (x,))
