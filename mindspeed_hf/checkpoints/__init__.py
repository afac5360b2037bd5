"""Checkpoints on disk: what a run's output directory holds and which checkpoint can be used (`layout.py`), whether
its files read whole (`readable.py`), and export as a Hugging Face model directory (`export.py`, streaming the
weights with `weights.py`; in the background during training with `background.py`). Writing a checkpoint is
Trainer's (wrapped by trainers/checkpoints.py) or accelerate's (runtime/state.py), over parallel/checkpoint.py."""

from .layout import CheckpointError, check_checkpoint, checkpoint_step, complete_checkpoints, newest_resumable
from .readable import unreadable_file

__all__ = ["CheckpointError", "check_checkpoint", "checkpoint_step", "complete_checkpoints", "newest_resumable",
           "unreadable_file"]
