"""The runtime floor: one Run per owner (a Trainer, or an accelerate loop's Accelerator), the one path a model takes
to be prepared (kernels, then `parallel.parallelize`), and the accelerate seam that brings every accelerate loop
through that path (`Accelerator.prepare`), Trainer's own accelerator included.

Nothing here knows Trainer: trainers/ builds on it (its arguments, checkpoints and logs are its own)."""

from .accelerator import adopting, install_accelerator_wiring, is_installed, uninstall_accelerator_wiring
from .plan import resolve_plan
from .prepare import ensure_dims, low_precision, prepare_model
from .run import Run, attach, resolve_config, run_of

__all__ = ["Run", "adopting", "attach", "ensure_dims", "install_accelerator_wiring", "is_installed", "low_precision",
           "prepare_model", "resolve_config", "resolve_plan", "run_of", "uninstall_accelerator_wiring"]
