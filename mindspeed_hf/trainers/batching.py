"""Token-budget batches inside Trainer (`data.max_tokens_per_batch`, `--mindspeed_max_tokens_per_batch`,
`MINDSPEED_HF_DATA_MAX_TOKENS_PER_BATCH`): Trainer.get_train_dataloader builds its loader as usual (column removal,
collator, workers, pinning: Trainer's own code), and with a budget set the same dataset and collate function are
handed out in batches of `mindspeed_hf.data.TokenBudgetBatchSampler` instead of `per_device_train_batch_size` rows.

accelerate prepares that loader like any other: over several data-parallel ranks it deals whole batches round-robin
(the sampler made their count a multiple of the dp ranks, so every rank gets the same number of steps and no row is
repeated), sets the sampler's epoch, and on resume skips the batches already trained. The loss stays normalised by
the real token count: Trainer's `num_items_in_batch` counts the labels of the batches it draws, whatever their size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..data import FlatteningCollator
from ..data.token_budget import TokenBudgetBatchSampler, row_lengths
from ..runtime import run_of

__all__ = ["train_dataloader"]

logger = logging.getLogger("mindspeed_hf")


def _packs(collator: Any) -> bool:
    """True for a collator that packs a batch into one row (ours, or HF's DataCollatorWithFlattening)."""
    from transformers import DataCollatorWithFlattening

    return isinstance(collator, (FlatteningCollator, DataCollatorWithFlattening))


def _dp_ranks(trainer: Any) -> int:
    """The ranks batches are dealt to: every process, except that a cp / tp group shares one batch."""
    run = run_of(trainer)
    same = run.plan.same_batch if run is not None and run.plan is not None else 1
    return max(1, trainer.args.world_size // same)


def train_dataloader(trainer: Any, original: Callable[[], Any]) -> Any:
    """Trainer.get_train_dataloader with the token budget applied when one is set (module docstring)."""
    loader = original()
    run = run_of(trainer)
    budget = run.config.data.max_tokens_per_batch if run is not None else 0
    if not budget:
        return loader
    from torch.utils.data import DataLoader, IterableDataset

    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        raise ValueError("data.max_tokens_per_batch needs a training dataset with a length (a map-style dataset); "
                         "this one is iterable: set it to 0, or materialise the dataset")
    args = trainer.args
    sampler = TokenBudgetBatchSampler(row_lengths(dataset), budget, packed=_packs(trainer.data_collator),
                                      seed=args.data_seed if args.data_seed is not None else args.seed,
                                      num_shards=_dp_ranks(trainer))
    logger.info("mindspeed_hf: data.max_tokens_per_batch=%d: %d %s batches per epoch over %d data-parallel ranks "
                "(per_device_train_batch_size is not used)", budget, len(sampler),
                "packed" if sampler.packed else "padded", sampler.num_shards)
    budgeted = DataLoader(dataset, batch_sampler=sampler, collate_fn=loader.collate_fn,
                          num_workers=loader.num_workers, pin_memory=loader.pin_memory,
                          worker_init_fn=loader.worker_init_fn, persistent_workers=loader.persistent_workers,
                          prefetch_factor=loader.prefetch_factor)
    return trainer.accelerator.prepare(budgeted)
