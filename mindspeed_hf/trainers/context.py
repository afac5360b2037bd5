"""Context (and tensor) parallelism inside Trainer: the data split over dp only, each batch split across cp in
compute_loss (under tp every rank of a tp group trains on the same batch).

With `parallel.cp > 1` the trainer's model went through parallelize's cp step (its attention runs over the cp
group). Two hooks then make Trainer's own loop train it:

- the accelerator's data loaders are prepared over accelerate's view of our world mesh (the accelerate seam,
  runtime/accelerator.py, as for every accelerate loop: every rank of a cp group gets the same batches);
- `compute_loss` gets this rank's share of each batch (`split_cp_batch`, labels shifted globally). Trainer's
  `num_items_in_batch`, gathered over every process, counts each dp batch cp times; divided by cp it is the global
  count, and Trainer's own loss scaling (x the process count) with FSDP2's average over dp_shard x cp then gives
  one process's gradient, and the logged mean loss one process's loss. Without a count, split_cp_batch counts the
  rank's dp batch itself.
"""

from __future__ import annotations

from typing import Any

from ..parallel.context.attached import context_of
from ..runtime import run_of

__all__ = ["check_metrics_at_init", "check_predictions", "split_inputs"]


def split_inputs(model: Any, inputs: dict[str, Any], num_items_in_batch: Any) -> tuple[dict[str, Any], Any]:
    """(inputs, num_items_in_batch) for Trainer.compute_loss: this rank's share under context parallelism, else as
    given. Called once per compute_loss (the wiring of Trainer.compute_loss)."""
    ctx = context_of(model)
    if ctx is None:
        return inputs, num_items_in_batch
    from ..parallel.context.model import split_cp_batch  # loaded with the cp step that attached `ctx`

    local = split_cp_batch(inputs, ctx, num_items_in_batch=None if num_items_in_batch is None
                           else float(num_items_in_batch))
    if num_items_in_batch is None:  # Trainer does not scale: the model divides by the count split_cp_batch made
        return local, None
    return local, local.pop("num_items_in_batch", None)


def check_predictions(trainer: Any, loss_only: bool) -> None:
    """Under context parallelism each rank's forward holds one slice of every sequence, so the logits Trainer would
    gather for `compute_metrics` or `predict` are slices, not predictions: refuse that evaluation in one line before
    it runs (`loss_only`: the evaluation asks for the loss alone, which is exact under cp)."""
    run = run_of(trainer)
    cp = run.plan.cp if run is not None and run.plan is not None else 1
    if cp > 1 and not loss_only:
        raise ValueError(f"parallel.cp={cp}: Trainer predictions (compute_metrics, predict) are not supported under "
                         "context parallelism (each rank's logits are one slice of every sequence; the evaluation "
                         "loss is supported); valid choices: no compute_metrics, prediction_loss_only=True, or "
                         "parallel.cp=1 to predict")


def check_metrics_at_init(trainer: Any) -> None:
    """At Trainer.__init__: a trainer that will evaluate with `compute_metrics` under cp is refused before training
    (check_predictions)."""
    args = trainer.args
    strategy = getattr(args, "eval_strategy", "no")
    evaluates = getattr(strategy, "value", strategy) != "no"
    check_predictions(trainer, loss_only=not evaluates or trainer.compute_metrics is None
                      or bool(args.prediction_loss_only))
