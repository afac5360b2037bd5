"""Token-budget batches: micro-batches sized in tokens instead of rows (`data.max_tokens_per_batch`).

A batch of long rows and a batch of short rows cost very different memory when both hold the same number of rows.
`TokenBudgetBatchSampler` forms batches of whole rows whose cost fits a budget:
- padded batches (a padding collator): rows x the longest row, since that is the tensor the model sees; rows are
  grouped by length so that little of it is padding;
- packed batches (a flattening collator: one row out): the sum of the rows' lengths.

The batches are formed once, from the lengths alone (rows sorted by length, index as the tie-break, then filled
greedily), so every epoch holds the same number of batches and every row exactly once; each epoch visits them in an
order drawn from (seed, epoch). Their count is made a multiple of `num_shards` (the data-parallel ranks) by
splitting the batches with most rows, so that accelerate's round-robin of whole batches over the ranks gives every
rank the same number of steps without repeating a row. Everything is a function of (lengths, budget, seed, epoch):
a resumed run that skips the first k batches of an epoch sees exactly the batches the interrupted one would have.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

__all__ = ["TokenBudgetBatchSampler", "batch_cost", "row_lengths"]


def batch_cost(lengths: Sequence[int], packed: bool) -> int:
    """Tokens a batch of rows with these lengths occupies: their sum when packed, rows x the longest when padded."""
    return sum(lengths) if packed else len(lengths) * max(lengths, default=0)


class TokenBudgetBatchSampler:
    """Batches of dataset indices whose cost (`batch_cost`) is at most `max_tokens` (module docstring).

    Args:
        lengths: tokens of each row (text and merged vision tokens: the length of its `input_ids`).
        max_tokens: the budget per batch; a row longer than it is an error, named with its index.
        packed: True when the collator packs a batch into one row (cost = the sum of the lengths).
        seed: the order of the batches in each epoch is drawn from (seed, epoch).
        num_shards: the batch count is made a multiple of it (the data-parallel ranks the batches are dealt to).
    """

    def __init__(self, lengths: Sequence[int], max_tokens: int, *, packed: bool = False, seed: int = 0,
                 num_shards: int = 1) -> None:
        if max_tokens < 1:
            raise ValueError(f"data.max_tokens_per_batch={max_tokens} must be >= 1")
        self.lengths = [int(n) for n in lengths]
        too_long = [i for i, n in enumerate(self.lengths) if n > max_tokens]
        if too_long:
            first = too_long[0]
            raise ValueError(f"data.max_tokens_per_batch={max_tokens}: row {first} has {self.lengths[first]} tokens "
                             f"({len(too_long)} rows exceed the budget; the longest has {max(self.lengths)}); raise "
                             "the budget or truncate the rows")
        self.max_tokens, self.packed, self.seed, self.num_shards = max_tokens, packed, seed, num_shards
        self.epoch = 0
        self.sampler = self  # accelerate sets the epoch through `batch_sampler.sampler` once it shards the batches
        self.batches = _shard_evenly(_fill(self.lengths, max_tokens, packed), num_shards)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose batch order __iter__ gives (Trainer sets it through accelerate's loader)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        for position in torch.randperm(len(self.batches), generator=generator).tolist():
            yield list(self.batches[position])


def _fill(lengths: list[int], max_tokens: int, packed: bool) -> list[list[int]]:
    """Rows sorted by length, filled greedily into batches that fit the budget (each new row is the batch's
    longest, so a padded batch costs its row count x the new row's length)."""
    batches: list[list[int]] = []
    current: list[int] = []
    total = 0
    for index in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        n = lengths[index]
        cost = total + n if packed else (len(current) + 1) * n
        if current and cost > max_tokens:
            batches.append(current)
            current, total = [], 0
        current.append(index)
        total += n
    if current:
        batches.append(current)
    return batches


def _shard_evenly(batches: list[list[int]], shards: int) -> list[list[int]]:
    """The batches, split (the one with most rows first, halves stay under the budget) until their count is a
    multiple of `shards`."""
    batches = [list(b) for b in batches]
    while len(batches) % shards:
        largest = max(range(len(batches)), key=lambda i: (len(batches[i]), -i))
        rows = batches[largest]
        if len(rows) < 2:
            raise ValueError(f"data.max_tokens_per_batch: {sum(map(len, batches))} rows make {len(batches)} batches, "
                             f"fewer than can be dealt evenly to {shards} data-parallel ranks; use more rows or fewer "
                             "ranks")
        batches[largest:largest + 1] = [rows[:len(rows) // 2], rows[len(rows) // 2:]]
    return batches


def row_lengths(dataset) -> list[int]:
    """The length of every row's `input_ids` (a datasets.Dataset column read at once; else row by row)."""
    columns = getattr(dataset, "column_names", None)
    if columns is not None and "input_ids" in columns:
        return [len(ids) for ids in dataset["input_ids"]]
    try:
        return [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
    except (KeyError, TypeError) as err:
        raise ValueError("data.max_tokens_per_batch sizes batches by each row's `input_ids`, which this training "
                         f"dataset's rows do not have ({type(err).__name__}: {err})") from None
