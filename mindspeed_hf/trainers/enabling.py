"""The package's switches: `mindspeed_hf.enable()` is the kernels (patches/apply.py) plus the accelerate seam
(runtime/accelerator.py) and the Trainer wiring (wiring.py), all or nothing; `mindspeed_hf.disable()` undoes them.

Everything enable() depends on is checked before anything changes: the releases (releases/supported.py), the config
and its backend, and the transformers / accelerate internals the wiring needs (releases/seams.py). A failure at any
point leaves every transformers symbol as it was before the call. The Trainer is wired right away where
transformers.trainer is imported already, else right after its first import (its seams checked then; a script that
never imports it never pays for it: the Trainer pulls in PEFT, bitsandbytes and datasets), and TrainingArguments'
own wrapper right after the arguments' import (arguments_wiring.py), which may come first.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType

from ..config import MindSpeedConfig
from ..parallel import quiesce_gloo_at_exit
from ..patches import apply, third_party
from ..releases import seams
from ..runtime import install_accelerator_wiring, uninstall_accelerator_wiring
from .arguments_wiring import install_arguments_wiring, uninstall_arguments_wiring

logger = logging.getLogger("mindspeed_hf")
_WIRING = "mindspeed_hf.trainers.wiring"  # imported with the Trainer only: its modules import the Trainer's
TRAINER_MODULE = "transformers.trainer"
ARGUMENTS_MODULE = "transformers.training_args"

__all__ = ["UnsupportedReleaseError", "disable", "enable"]


class UnsupportedReleaseError(RuntimeError):
    """The installed transformers / accelerate lack an internal the Trainer wiring cannot do without."""


def enable(config: MindSpeedConfig | None = None) -> None:
    """Patch the kernels into every supported family, make `config` the process config, wire accelerate.Accelerator
    (so every accelerate loop prepares models through mindspeed_hf) and transformers.Trainer (so a plain Trainer /
    SFTTrainer behaves like MindSpeedTrainer). Idempotent.

    Raises (RuntimeError / ValueError, one line naming what is wrong) before changing anything when a release is
    outside the supported range, the config is invalid, or a Trainer internal the wiring needs is missing (checked
    here when transformers.trainer is imported already; else at its import, where a missing one turns the
    accelerator off with one warning)."""
    was_enabled = apply.is_enabled()
    trainer_imported = TRAINER_MODULE in sys.modules
    problem = seams.problems(trainer=trainer_imported)
    if problem is not None:
        raise UnsupportedReleaseError(problem)
    apply.enable(config)
    quiesce_gloo_at_exit()  # Trainer's DDP, DeepSpeed and accelerate start gloo groups without init_distributed
    try:
        install_accelerator_wiring()
        if trainer_imported:
            _wiring().install_trainer_wiring(checked=True)  # (problems() above read the Trainer's seams)
        else:  # a script without a Trainer never imports it (nor PEFT, bitsandbytes, datasets through it)
            third_party.when_imported(ARGUMENTS_MODULE, _wire_imported_arguments)
            third_party.when_imported(TRAINER_MODULE, _wire_imported_trainer)
    except BaseException:
        if not was_enabled:
            uninstall_accelerator_wiring()
            apply.disable()
        raise


def _wiring() -> ModuleType:
    from . import wiring

    return wiring


def _wire_imported_arguments(module: ModuleType) -> None:
    """transformers' training_args module was just imported (maybe while transformers is still importing the
    Trainer's modules): wrap TrainingArguments.__post_init__ alone, which imports nothing of transformers, so that
    arguments built before the Trainer is imported get their DeepSpeed steps too. Its seam is checked with the
    Trainer's (seams.py); a release without the method keeps it unwrapped."""
    if seams.available("__post_init__"):
        install_arguments_wiring(module.TrainingArguments)


def _wire_imported_trainer(module: ModuleType) -> None:
    """transformers.trainer was just imported (after enable()): wire it, once its seams are checked. A release
    lacking one turns the accelerator off with one warning (as `import mindspeed_hf` does), rather than failing the
    import that brought the Trainer in."""
    if _WIRING in sys.modules and _wiring().is_installed():
        return  # wired already (enable() called again before the import)
    problem = seams.problems()
    if problem is not None:
        logger.warning("%s. The accelerator stays off: nothing is patched any more, models run unaccelerated",
                       problem)
        disable()
        return
    _wiring().install_trainer_wiring(checked=True)


def disable() -> None:
    """Remove the Trainer and accelerate wiring and restore every patched symbol exactly. Models keep working,
    unaccelerated."""
    if _WIRING in sys.modules:  # never imported: never installed
        _wiring().uninstall_trainer_wiring()
    uninstall_arguments_wiring()
    uninstall_accelerator_wiring()
    apply.disable()
