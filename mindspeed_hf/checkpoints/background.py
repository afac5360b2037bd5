"""`checkpoints: {export_hf: true}`: every checkpoint a Trainer run saves, exported as a Hugging Face directory while
training goes on.

Once a checkpoint is complete (its COMPLETE marker written), the main rank starts this module as a separate process
(`python -m mindspeed_hf.checkpoints.background CHECKPOINT OUTPUT_DIR/hf/checkpoint-N`: export.py's `export` with
`overwrite`, the run's own directory: a checkpoint saved again after a restart replaces its export) at low CPU
priority, outside the training job (no torchrun
variables, no accelerator: the export is a CPU reader of the files just written) and returns to training. One export
runs at a time: the next checkpoint save first waits for the previous export (so Trainer's rotation never removes a
checkpoint still being read), and so does the end of train(). A failed export is one warning naming its log
(OUTPUT_DIR/hf/checkpoint-N.log, removed when the export succeeds); the run goes on. The exports are not rotated:
they are what a user keeps to evaluate or publish.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass

__all__ = ["BackgroundExport", "export_dir", "finish", "start"]

logger = logging.getLogger("mindspeed_hf")

#: where the exports go, under the run's output directory
EXPORTS = "hf"
#: what the export process must not inherit: the launcher's process-group variables and the accelerators
_NOT_INHERITED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")




@dataclass
class BackgroundExport:
    """One export process, the checkpoint it reads, the directory it writes and its log."""

    checkpoint: str
    out: str
    log: str
    process: subprocess.Popen


def export_dir(checkpoint: str) -> str:
    """OUTPUT_DIR/hf/checkpoint-N for OUTPUT_DIR/checkpoint-N (outside Trainer's `checkpoint-*` rotation)."""
    checkpoint = os.path.normpath(checkpoint)
    return os.path.join(os.path.dirname(checkpoint), EXPORTS, os.path.basename(checkpoint))


def start(checkpoint: str) -> BackgroundExport:
    """Start exporting the complete `checkpoint`; returns at once."""
    out = export_dir(checkpoint)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    env.update(MINDSPEED_HF_AUTO="0", CUDA_VISIBLE_DEVICES="", ASCEND_RT_VISIBLE_DEVICES="")
    log = out + ".log"
    with open(log, "w") as stream:
        process = subprocess.Popen(
            [sys.executable, "-m", __name__, checkpoint, out], env=env, stdout=stream,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    logger.info("mindspeed_hf: exporting %s to %s in the background", checkpoint, out)
    return BackgroundExport(checkpoint, out, log, process)


def finish(export: BackgroundExport | None) -> bool:
    """Wait for `export` (None: nothing to wait for); True when it wrote its directory. A failure is one warning
    naming the log; a success removes the log."""
    if export is None:
        return True
    if export.process.poll() is None:
        logger.info("mindspeed_hf: waiting for the background export of %s", export.checkpoint)
    if export.process.wait() == 0:
        os.remove(export.log)
        return True
    with open(export.log) as f:
        last = (f.read().strip().splitlines() or ["(no output)"])[-1]
    logger.warning("mindspeed_hf: checkpoints.export_hf: exporting %s failed (%s); log: %s", export.checkpoint, last,
                   export.log)
    return False


def _main(argv: list[str]) -> int:
    """The export process: below the training processes' priority (the step keeps the CPU), one export, and its
    failure as one line (the last line of the log, which `finish` quotes)."""
    checkpoint, out = argv
    os.nice(10)
    from .export import export

    try:
        export(checkpoint, out, overwrite=True)
    except Exception as err:  # noqa: BLE001 - the log's last line names what failed, for finish()
        print(f"mindspeed_hf export of {checkpoint}: error: {' '.join(str(err).split()) or type(err).__name__}")
        return 2
    print(f"mindspeed_hf: exported {checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
