"""torchrun worker (gloo, 2 ranks): a custom training loop under FSDP2 with logits made on first read.

Rank 0 first runs plain Hugging Face (mindspeed_hf disabled) on the global batch, then every rank enables
mindspeed_hf and runs the same steps data-parallel under FSDP2, in two shardings:
  user: `fully_shard` on every decoder layer and on the model, as a user's own loop does;
  ours: mindspeed_hf.parallel.apply_fsdp (final norm + lm_head as their own group);
and once under DDP. `user` reads only the loss (the logits must never be built); `ours` and `ddp` add a term built
on `outputs.logits` before the backward (they are built once, with HF's gradients). Afterwards a first read of
logits whose forward is behind an optimizer step must raise the error that names the way out. Rank 0 writes the
report to --out.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from worker import GLOBAL_BATCH, SEQ, batch, build_model, full_params, make_opt, max_diff

import mindspeed_hf
from mindspeed_hf.parallel.dims import ParallelDims, fsdp_mesh, init_distributed
from mindspeed_hf.parallel.fsdp import apply_fsdp
from mindspeed_hf.patches.lazy_logits import DeferredLogits

STEPS = 3


def _extra(outputs) -> torch.Tensor:
    """A loss term on the logits, summed over this forward's rows / the global row count (so ranks add up)."""
    return 1e-2 * outputs.logits.float().logsumexp(-1).pow(2).sum() / (GLOBAL_BATCH * SEQ)


def _step(model, opt, step: int, read: bool, rows: slice, scale: int) -> tuple[float, object]:
    ids, labels = batch(step)
    n = (labels[:, 1:] != -100).sum()
    outputs = model(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=n)
    loss = outputs.loss + (_extra(outputs) if read else 0)
    (loss * scale).backward()  # FSDP averages gradients over the ranks
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    if dist.is_initialized() and scale > 1:
        dist.all_reduce(total)
    return total.item(), outputs


def _reference(read: bool) -> tuple[list[float], dict]:
    model = build_model()
    opt = make_opt(model)
    losses = [_step(model, opt, s, read, slice(None), 1)[0] for s in range(STEPS)]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _sharded(kind: str, read: bool, rank: int, world: int, made: list) -> dict:
    model = build_model()
    if kind == "user":
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        dims = ParallelDims(world_size=world)
        apply_fsdp(model, fsdp_mesh(dims.build_mesh("cpu"), dims))
    opt = make_opt(model)
    per = GLOBAL_BATCH // world
    rows = slice(rank * per, (rank + 1) * per)
    losses, deferred = [], True
    for step in range(STEPS):
        loss, outputs = _step(model, opt, step, read, rows, world)
        losses.append(loss)
        deferred = deferred and isinstance(outputs.logits, DeferredLogits)
    try:  # the last forward is behind an optimizer step now (a first read where the loss did not read them)
        outputs.logits.sum()
        stale = "no error"
    except RuntimeError as err:
        stale = str(err)
    model = model.module if kind == "ddp" else model
    return {"losses": losses, "deferred": deferred, "made": list(made), "stale": stale, "params": full_params(model)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    made: list = []
    original = DeferredLogits.materialize

    def counting(self):
        first = self._value is None
        value = original(self)
        if first:
            made.append(list(self.shape))
        return value

    DeferredLogits.materialize = counting
    report = {}
    for kind, read in (("user", False), ("ours", True), ("ddp", True)):
        ref_losses, ref_params = _reference(read) if rank == 0 else (None, None)
        mindspeed_hf.enable()
        made.clear()
        run = _sharded(kind, read, rank, world, made)
        mindspeed_hf.disable()
        params = run.pop("params")
        if rank == 0:
            run["loss_diff"] = max(abs(a - b) for a, b in zip(run["losses"], ref_losses))
            run["param_diff"] = max_diff(params, ref_params)
            report[kind] = run
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
