"""Every name of transformers' (and accelerate's) internals the Trainer integration depends on, in one list.

The integration keeps Trainer's own code paths (checkpoint writing, rotation, RNG state, best-model tracking) and
adds ours around them; where it must replace a private method, or read or set a private attribute, the name is
listed here with the reason and dated against the real wheels (`since` / `until`: the first transformers release
that has it / no longer has it, found by reading every release's trainer.py, training_args.py and distributed/).

A seam with a `without` note is optional: releases that lack it take another path with the same result (the note
says which), and the code asks `available(name)` before using it. A required seam that the installed release lacks
makes `problems()` name it; enable() checks that before it changes anything, so an unservable release is refused with
one line and nothing patched. tests/trainer/test_seams.py checks each name against the installed packages by its
dates, so a rename or a wrong date shows up as a failing test.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from packaging.version import Version

__all__ = ["SEAMS", "Seam", "available", "check", "missing", "problems"]


@dataclass(frozen=True)
class Seam:
    """One internal name we use. `kind`: "method" (a Trainer method we wrap or replace), "attribute" (a name
    Trainer's own code reads, found in its source), "module" (a name in transformers.trainer), "arguments" (a
    TrainingArguments member), "accelerate" (an accelerate internal)."""

    name: str
    kind: str
    why: str
    since: str = "4.57"  # first transformers release (in our range) that has it
    until: str | None = None  # first release that no longer has it (the seam is then not used)
    without: str | None = None  # optional: what releases without it do instead (same result)

    @property
    def required(self) -> bool:
        """A release within the seam's dates that lacks it cannot be served (there is no other path)."""
        return self.without is None


SEAMS: tuple[Seam, ...] = (
    # wrapped: Trainer's own body runs, ours runs around it
    Seam("create_accelerator_and_postprocess", "method",
         "accelerator created without accelerate's FSDP plugin (we shard); it keeps our sharded model unwrapped"),
    Seam("evaluation_loop", "method", "groups left gathered by an evaluation forward are resharded afterwards"),
    Seam("save_model", "method", "a sharded model is saved as consolidated safetensors / model shards (DCP)"),
    Seam("_save_checkpoint", "method",
         "Trainer writes the checkpoint (every run); we mark it COMPLETE once every rank is done, then let Trainer's "
         "rotation run (checkpoints.py)"),
    Seam("_rotate_checkpoints", "method",
         "Trainer's rotation, held back until the new checkpoint is COMPLETE (later releases: rotate_checkpoints)",
         until="5.2"),
    # replaced while the model is FSDP2-sharded: Trainer's versions would treat DTensors as whole tensors
    Seam("_save_optimizer_and_scheduler", "method", "optimizer shards through DCP, not one rank's torch.save"),
    Seam("_load_from_checkpoint", "method", "model shards read back through DCP"),
    Seam("_load_optimizer_and_scheduler", "method", "optimizer shards read back through DCP"),
    Seam("_load_best_model", "method", "the best checkpoint's shards read back into the sharded model"),
    Seam("_move_model_to_device", "method", "a sharded model owns its placement (`.to()` would undo cpu_offload)"),
    Seam("_defer_fsdp_gradient_reduction", "method",
         "gradient accumulation reduces once per step (HSDP: reduce-scatter per micro-batch, all-reduce once)",
         since="5.23", without="every micro-batch is reduced, which gives the same result"),
    # read by Trainer's own code
    Seam("is_distributed_loading_by_transformers", "attribute",
         "set on the trainer of a sharded model: Trainer then leaves placement and gradient reduction to the model",
         since="5.19", without="the accelerator's prepare_model keeps the model as sharded (fsdp._keep_sharded) and "
                               "_move_model_to_device leaves its placement"),
    Seam("_is_fsdp_managed_module", "attribute",
         "set on a sharded model: generate() keeps the ranks in step and accumulation defers the reduction"),
    # transformers.trainer module names
    Seam("apply_liger_kernel", "module",
         "made a no-op during train() for a model we accelerate (so Liger does not patch the same layers)",
         since="5.2", without="Liger is applied in Trainer.__init__; use_liger_kernel with our kernels is refused"),
    Seam("rotate_checkpoints", "module",
         "Trainer's rotation, held back during a checkpoint save until the new checkpoint is COMPLETE, so "
         "save_total_limit never deletes the last complete checkpoint", since="5.2",
         without="the trainer's _rotate_checkpoints method is held back instead"),
    # TrainingArguments internals
    Seam("_setup_devices", "arguments",
         "recomputed once with use_cpu on CPU under torchrun, so accelerate counts every process (use_cpu is given "
         "back afterwards)"),
    Seam("__post_init__", "arguments",
         "wrapped (DeepSpeed, trainers/deepspeed.py): our parallelism with DeepSpeed refused and use_cpu set for a "
         "CPU launch before the devices are set up; deepspeed.comm initialised after, before a ZeRO-3 model is built"),
    # accelerate internals
    Seam("AcceleratorState._reset_state", "accelerate",
         "drop an FSDP plugin an earlier Accelerator left in accelerate's process-wide state"),
    Seam("Accelerator._prepare_device_mesh", "accelerate",
         "context parallelism: data loaders prepared over our world mesh, so a cp group shares its batches "
         "(trainers/context.py)"),
)


def _transformers_version() -> Version:
    import transformers

    return Version(transformers.__version__)


# Where transformers reads the attributes we set: the Trainer, and its FSDP helpers (moved in 5.0).
_READERS = ("transformers.trainer", "transformers.distributed.fsdp", "transformers.integrations.fsdp")


def _reader_modules() -> list:
    import importlib

    found = []
    for name in _READERS:
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            continue
    return found


def _present(seam: Seam) -> bool:
    if seam.kind == "method":
        from transformers import Trainer

        return callable(getattr(Trainer, seam.name, None))
    if seam.kind == "attribute":
        return any(seam.name in inspect.getsource(module) for module in _reader_modules())
    if seam.kind == "module":
        import transformers.trainer as hf_trainer

        return callable(getattr(hf_trainer, seam.name, None))
    if seam.kind == "arguments":
        from transformers import TrainingArguments

        return seam.name in vars(TrainingArguments)
    owner, attribute = seam.name.split(".")
    import accelerate
    import accelerate.state

    cls = getattr(accelerate.state, owner, None) or getattr(accelerate, owner, None)
    return callable(getattr(cls, attribute, None))


def missing(version: Version | None = None) -> list[Seam]:
    """The seams the installed releases should have (by their dates) but do not, optional ones included."""
    version = version or _transformers_version()
    return [s for s in SEAMS if _in_range(s, version) and not _present(s)]


def _in_range(seam: Seam, version: Version) -> bool:
    return version >= Version(seam.since) and (seam.until is None or version < Version(seam.until))


def available(name: str) -> bool:
    """True when the installed release has seam `name` (feature detection; an optional seam is otherwise not
    used, and its `without` path runs)."""
    return _present(next(s for s in SEAMS if s.name == name))


def _owner(seam: Seam) -> str:
    """The package and installed release a seam belongs to, e.g. "accelerate 1.15.0"."""
    import importlib

    package = "accelerate" if seam.kind == "accelerate" else "transformers"
    return f"{package} {importlib.import_module(package).__version__}"


def problems() -> str | None:
    """One line naming every required seam the installed releases lack (None when all are there). Changes nothing:
    enable() asks before it patches anything."""
    gone = [s for s in missing() if s.required]
    if not gone:
        return None
    names = "; ".join(f"{_owner(s)} no longer has {s.name} ({s.why})" for s in gone)
    return (f"mindspeed_hf: {names}; this release of mindspeed_hf supports transformers 4.57 to 5.x and accelerate "
            "1.10 to 1.x - install one of those, or set MINDSPEED_HF_AUTO=0 to run without the accelerator")


def check() -> None:
    """Raise RuntimeError with problems() when a required seam is gone."""
    message = problems()
    if message is not None:
        raise RuntimeError(message)
