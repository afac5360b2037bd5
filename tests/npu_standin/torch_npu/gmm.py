"""npu_grouped_matmul: grouped GEMM over the token (M) axis or the reduction (K) axis. No autograd on the device.

  MoE forward:          ([x[M, K]], [W[E, K, N]], group_list=counts, split_item=2, group_type=0) -> [Y[M, N]]
  MoE weight gradient:  ([x.T[K, M]], [dY[M, N]], group_list=counts, split_item=3, group_type=2) -> [dW[E, K, N]]
group_list is an int64 tensor (or a host int list, the `.List` overload): per-group counts (group_list_type=1) or
cumulative ends (group_list_type=0). split_item 0/1 return one tensor per group, 2/3 a single tensor.
"""

from __future__ import annotations

import torch

from . import _checks as C

OP = "npu_grouped_matmul"
MAX_GROUPS = 1024
MAX_K = 65536  # K must be < 65536
MAX_LIST = 128


def _tensor_list(name: str, value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{OP}(): argument '{name}' must be a list of Tensors, not {type(value).__name__}")
    C.check(1 <= len(value) <= MAX_LIST, OP, f"{name} must hold 1..{MAX_LIST} tensors, got {len(value)}")
    return [C.float_tensor(OP, f"{name}[{i}]", t) for i, t in enumerate(value)]


def _group_counts(group_list, group_list_type: int) -> list[int]:
    if isinstance(group_list, torch.Tensor):
        C.check(group_list.dim() == 1, OP, f"group_list must be 1-D, got shape {list(group_list.shape)}")
        C.check(group_list.dtype == torch.int64, OP, f"group_list must be int64, got {group_list.dtype}")
        values = [int(v) for v in group_list.tolist()]
    else:
        values = C.int_list(OP, "group_list", group_list)
    C.check(1 <= len(values) <= MAX_GROUPS, OP, f"group_list must have 1..{MAX_GROUPS} groups, got {len(values)}")
    if group_list_type == 0:
        counts = [b - a for a, b in zip([0] + values, values)]
        C.check(min(counts) >= 0, OP, f"cumulative group_list (group_list_type=0) must be non-decreasing: {values}")
    else:
        counts = values
        C.check(min(counts) >= 0, OP, f"group counts (group_list_type=1) must be >= 0: {values}")
    return counts


def _check_unsupported(kwargs: dict) -> None:
    for name, value in kwargs.items():
        if value is not None and not (isinstance(value, (list, tuple)) and len(value) == 0):
            raise C.unsupported(OP, f"{name} (quantised / fused-activation grouped matmul)")


def _weights_per_group(ws: list[torch.Tensor], groups: int) -> list[torch.Tensor]:
    if len(ws) == 1 and ws[0].dim() == 3:
        C.check(ws[0].shape[0] == groups, OP, f"weight has {ws[0].shape[0]} experts but group_list {groups} groups")
        return list(ws[0].unbind(0))
    C.check(
        len(ws) == groups and all(w.dim() == 2 for w in ws), OP,
        f"weight must be one [E, K, N] tensor or E={groups} [K, N] tensors",
    )
    return ws


def _biases_per_group(bias, groups: int, n: int) -> list:
    if bias is None or (isinstance(bias, (list, tuple)) and len(bias) == 0):
        return [None] * groups
    bs = _tensor_list("bias", bias)
    if len(bs) == 1 and bs[0].dim() == 2:
        bs = list(bs[0].unbind(0))
    C.check(len(bs) == groups and all(tuple(b.shape) == (n,) for b in bs), OP, f"bias must be {groups} x [N={n}]")
    return bs


def _split_rows(counts, m: int, what: str) -> list[tuple[int, int]]:
    C.check(sum(counts) == m, OP, f"group_list covers {sum(counts)} rows but {what} has {m}")
    ends = torch.tensor(counts).cumsum(0).tolist()
    return list(zip([0] + ends[:-1], ends))


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, tuning_config=None, output_dtype=None, x_dtype=None,
                       weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None):
    """Grouped matmul (see the module docstring). Returns a list of tensors; a backward through them raises."""
    xs, ws = _tensor_list("x", x), _tensor_list("weight", weight)
    _check_unsupported(dict(
        scale=scale, offset=offset, antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
        per_token_scale=per_token_scale, activation_input=activation_input,
        activation_quant_scale=activation_quant_scale, activation_quant_offset=activation_quant_offset,
        output_dtype=output_dtype, x_dtype=x_dtype, weight_dtype=weight_dtype, scale_dtype=scale_dtype,
        per_token_scale_dtype=per_token_scale_dtype,
    ))
    split_item = C.integer(OP, "split_item", 0 if split_item is None else split_item)
    group_type = -1 if group_type is None else C.integer(OP, "group_type", group_type)
    group_list_type = C.integer(OP, "group_list_type", 0 if group_list_type is None else group_list_type)
    if C.integer(OP, "act_type", 0 if act_type is None else act_type) != 0:
        raise C.unsupported(OP, f"act_type={act_type}")
    if tuning_config is not None:
        C.int_list(OP, "tuning_config", tuning_config)  # a performance hint only
    C.check(split_item in (0, 1, 2, 3), OP, f"split_item must be 0..3, got {split_item}")
    C.check(group_type in (-1, 0, 2), OP, f"group_type must be -1 (none), 0 (M axis) or 2 (K axis), got {group_type}")
    C.check(group_list_type in (0, 1), OP, f"group_list_type must be 0 (cumulative) or 1 (counts): {group_list_type}")
    C.same_dtype(OP, **{f"x{i}": t for i, t in enumerate(xs)}, **{f"weight{i}": t for i, t in enumerate(ws)})
    single = split_item in (2, 3)
    biases = []
    if group_type == -1:
        C.check(group_list is None, OP, "group_list needs group_type 0 (split M) or 2 (split K)")
        C.check(len(xs) == len(ws), OP, f"ungrouped call needs as many x ({len(xs)}) as weights ({len(ws)})")
        biases = _biases_per_group(bias, len(ws), ws[0].shape[-1])
        pairs = list(zip(xs, ws, biases))
        k = max(xi.shape[-1] for xi in xs)
    else:
        C.check(group_list is not None, OP, f"group_type={group_type} needs group_list")
        C.check(len(xs) == 1, OP, "a grouped call takes x as a single tensor")
        counts = _group_counts(group_list, group_list_type)
        xm = xs[0]
        C.check(xm.dim() == 2, OP, f"x must be 2-D, got shape {list(xm.shape)}")
        if group_type == 0:
            wg = _weights_per_group(ws, len(counts))
            k = xm.shape[1]
            C.check(all(w.shape[0] == k for w in wg), OP, f"weight K must equal x's K={k}")
            biases = _biases_per_group(bias, len(counts), wg[0].shape[1])
            rows = _split_rows(counts, xm.shape[0], "x")
            pairs = [(xm[a:b], w, bi) for (a, b), w, bi in zip(rows, wg, biases)]
        else:
            C.check(bias is None, OP, "bias is not supported with group_type=2")
            C.check(len(ws) == 1 and ws[0].dim() == 2, OP, "group_type=2 takes weight as a single [M, N] tensor")
            k = xm.shape[0]
            C.check(ws[0].shape[0] == xm.shape[1], OP, f"x is [K, M={xm.shape[1]}], weight has {ws[0].shape[0]} rows")
            rows = _split_rows(counts, xm.shape[1], "x.T")
            pairs = [(xm[:, a:b], ws[0][a:b], None) for a, b in rows]
    C.check(k < MAX_K, OP, f"K={k} must be < {MAX_K}")
    with torch.no_grad():
        ys = []
        for xi, wi, bi in pairs:
            C.check(xi.shape[-1] == wi.shape[0], OP, f"x [.., {xi.shape[-1]}] and weight {list(wi.shape)} mismatch")
            y = xi.float() @ wi.float()
            ys.append((y if bi is None else y + bi.float()).to(xs[0].dtype))
        if single:
            ys = [torch.stack(ys) if group_type == 2 else torch.cat(ys, dim=0)]
    inputs = [*xs, *ws, *[b for b in biases if b is not None]]
    return list(C.no_autograd(OP, ys, inputs))
