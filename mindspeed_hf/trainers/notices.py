"""transformers' DDP notice, held while TrainingArguments are built: on a CPU multi-process run without use_cpu,
TrainingArguments says the process group is up but the run is not distributed - true of accelerate's view, and
about DDP, which a model we shard does not use. It is printed once the trainer knows whether we shard, or dropped.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

__all__ = ["DDP_NOTICE", "HeldNotice", "ddp_notice_held", "release_ddp_notice"]

#: transformers' TrainingArguments notice on a CPU multi-process run without use_cpu (accelerate sees no DDP); about
#: DDP, which a model we shard does not use.
DDP_NOTICE = "torch.distributed process group is initialized, but parallel_mode != ParallelMode.DISTRIBUTED"


class HeldNotice(logging.Filter):
    """Holds back transformers' DDP notice (the records kept in `held`) until it is known whether we shard."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith(DDP_NOTICE):
            self.held.append(record)
            return False
        return True

    def release(self, sharded: bool) -> None:
        """Emit the held notice when the model is not sharded by us (it then is about the run); drop it otherwise."""
        if not sharded:
            for record in self.held:
                logging.getLogger(record.name).handle(record)
        self.held.clear()


@contextlib.contextmanager
def ddp_notice_held(args: Any = None) -> Iterator[HeldNotice]:
    """While TrainingArguments are built: transformers' DDP notice held back (`release` says what becomes of it).
    Given the arguments being built, the notice is kept for them until their trainer's `release_ddp_notice`."""
    gate = HeldNotice()
    hf_logger = logging.getLogger("transformers.training_args")
    hf_logger.addFilter(gate)
    try:
        yield gate
    finally:
        hf_logger.removeFilter(gate)
        if args is not None:
            _HELD[id(args)] = gate


#: id(TrainingArguments) -> transformers' DDP notice held while they were built.
_HELD: dict[int, HeldNotice] = {}


def release_ddp_notice(args: Any, sharded: bool) -> None:
    """transformers' DDP notice for these arguments: printed when we do not shard the model, dropped when we do."""
    notice = _HELD.pop(id(args), None)
    if notice is not None:
        notice.release(sharded)
