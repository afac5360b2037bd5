"""Worker for tests/distributed/test_faults.py: Trainer runs under torchrun (gloo, CPU) that a fault interrupts.

  elastic (2 ranks, torchrun --max-restarts 2): an unmodified Trainer script - no resume argument - saving every step.
      Attempt 0 trains the uninterrupted references (DDP, then FSDP2 dp_shard=2) into their own directories, then the
      DDP run, whose rank 1 is killed (SIGKILL) in step 4. torchrun restarts both ranks; attempt 1 resumes the DDP
      run by itself and finishes it, then starts the FSDP2 run, whose rank 1 is killed while it writes checkpoint-4.
      Attempt 2 resumes that one and finishes it (--cases: which of them run). Rank 0 records every run's losses and
      final parameters in --out
      (the file is kept across attempts), and each attempt's resume line.
  stall (2 ranks, no restarts): a plain Trainer (DDP) whose rank 1 sleeps at the start of step 3; the others wait in
      the step's gradient all-reduce. The hang watch (parallel.collective_timeout from the environment) ends the job.
  mistake (2 ranks): a plain Trainer whose settings (MINDSPEED_HF_CONFIG, from the test) cannot be built.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from crash_driver import collate, dataset, tiny_model  # noqa: E402

import mindspeed_hf  # noqa: E402, F401 - the accelerator on, as a user script
from mindspeed_hf.runtime import elastic  # noqa: E402

STEPS, KILL_STEP = 6, 4
RANK = int(os.environ.get("RANK", "0"))
#: the elastic runs: name -> (FSDP2, where rank 1 is killed)
CASES = {"ddp": (False, "step"), "fsdp2": (True, "save")}


def _args(out_dir: Path, fsdp: bool):
    from transformers import TrainingArguments

    common = dict(output_dir=str(out_dir), max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-2,
                  logging_steps=1, save_steps=1, report_to="none", disable_tqdm=True, seed=0, use_cpu=True,
                  dataloader_pin_memory=False)
    if fsdp:
        return mindspeed_hf.MindSpeedTrainingArguments(**common, mindspeed_dp_shard=2)
    return TrainingArguments(**common)


def _train(out_dir: Path, fsdp: bool, callbacks: list) -> tuple[dict[int, float], list[float]]:
    """One run as a user script makes it: no resume argument. Returns (losses by step, the final parameters)."""
    from torch.distributed.tensor import DTensor
    from transformers import Trainer

    trainer = Trainer(model=tiny_model(), args=_args(out_dir, fsdp), train_dataset=dataset(), data_collator=collate,
                      callbacks=callbacks)
    losses: dict[int, float] = {}
    compute = trainer.compute_loss

    def compute_loss(*a, **k):
        loss = compute(*a, **k)
        losses[trainer.state.global_step + 1] = float(loss.detach())
        return loss

    trainer.compute_loss = compute_loss
    trainer.train()
    params = [(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten().tolist()
              for p in trainer.model.parameters()]
    return losses, [x for chunk in params for x in chunk]


def _killer(when: str, marker: Path):
    """A callback that kills rank 1 (once: the marker file says it happened) in step KILL_STEP, or while it writes
    checkpoint-KILL_STEP."""
    from transformers import TrainerCallback

    class Kill(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if when == "step" and state.global_step + 1 == KILL_STEP:
                self._kill()

        def on_step_end(self, args, state, control, **kwargs):
            if when == "save" and state.global_step == KILL_STEP:  # the save of this step runs next: cut it
                save = torch.save  # rank 1's first torch.save of it (its RNG state, after the model's DCP shards)

                def torch_save(obj, f, *a, **k):
                    self._kill()
                    return save(obj, f, *a, **k)

                torch.save = torch_save

        def _kill(self):
            if RANK == 1 and not marker.exists():
                marker.write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

    return Kill()


def elastic_runs(out: Path, root: Path, cases: list[str]) -> None:
    record = json.loads(out.read_text()) if out.exists() else {"attempts": []}
    again = elastic.restart()
    record["attempts"].append(str(again) if again else "first")
    for name in cases:
        fsdp, when = CASES[name]
        if name in record:  # finished in an earlier attempt
            continue
        if f"reference_{name}" not in record:
            losses, params = _train(root / f"reference_{name}", fsdp, [])
            record[f"reference_{name}"] = {"losses": losses, "params": params}
            _write(out, record)
        losses, params = _train(root / name, fsdp, [_killer(when, root / f"killed_{name}")])
        record[name] = {"losses": losses, "params": params, "attempt": record["attempts"][-1],
                        "checkpoints": sorted(p.name for p in (root / name).glob("checkpoint-*"))}
        _write(out, record)


def stall(out: Path, root: Path, cases: list[str]) -> None:
    from transformers import TrainerCallback

    class Stall(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if RANK == 1 and state.global_step + 1 == 3:
                (root / "stalled_at").write_text(str(time.time()))
                time.sleep(300)

    _train(root / "stall", False, [Stall()])
    _write(out, {"finished": True})


def mistake(out: Path, root: Path, cases: list[str]) -> None:
    _train(root / "mistake", False, [])
    _write(out, {"finished": True})


def _write(out: Path, record: dict) -> None:
    if RANK == 0:
        out.write_text(json.dumps(record))
    if dist.is_initialized():
        dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["elastic", "stall", "mistake"])
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES), help="the elastic runs, in order")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    run = {"elastic": elastic_runs, "stall": stall, "mistake": mistake}[opts.scenario]
    run(Path(opts.out), Path(opts.root), opts.cases.split(","))


if __name__ == "__main__":
    main()
