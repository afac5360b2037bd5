"""Driver for tests/trainer/test_crash_resume.py: kill Trainer runs while they save, many times, and resume them.

Imports torch and transformers once, then forks every run (a fork costs milliseconds where a new interpreter costs
seconds), so a loop of kills stays cheap. `--ranks 1`: plain transformers.Trainer (wired by `import mindspeed_hf`)
in one process. `--ranks 2`: MindSpeedTrainer with FSDP2 dp_shard=2 on two gloo processes, started with the
variables torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, ...). Each iteration kills a run with SIGKILL, either at an
injected point of a save (the k-th file write, rotation delete or marker; a torch.save file may be left half
written) or after a random delay, then checks every checkpoint marked COMPLETE reads whole, resumes with
resume_from_checkpoint=True and records which checkpoint it continued from and the exact per-step losses.
Prints one line `RESULT <JSON>`: the uninterrupted run's losses and parameter digest, one entry per iteration.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import socket
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

import mindspeed_hf  # noqa: E402
from mindspeed_hf.checkpoints import unreadable_file  # noqa: E402
from mindspeed_hf.parallel import checkpoint as ckpt_lib  # noqa: E402
from mindspeed_hf.trainers import checkpoints  # noqa: E402

STEPS, N = 5, 40


def tiny_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        max_position_embeddings=32, tie_word_embeddings=False))


def dataset():
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (ids := torch.randint(1, 64, (12,), generator=g).tolist()), "labels": ids}
            for _ in range(N)]


def collate(batch):
    ids = torch.tensor([x["input_ids"] for x in batch])
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


# ---------------------------------------------------------------------------------------------- kill points
class Killer:
    """SIGKILL this process at the `at`-th save event (1-based); `at` = 0 only counts them."""

    def __init__(self, at: int, tear: bool) -> None:
        self.at, self.tear, self.count = at, tear, 0

    def event(self, path: str | None = None, payload: bytes | None = None) -> None:
        self.count += 1
        if self.at and self.count == self.at:
            if self.tear and path and payload:  # a file cut in the middle of its write
                with open(path, "wb") as f:
                    f.write(payload[: len(payload) // 2])
            os.kill(os.getpid(), signal.SIGKILL)

    def install(self) -> None:
        import safetensors.torch
        import transformers.trainer_callback as cb

        save, save_file, to_json = torch.save, safetensors.torch.save_file, cb.TrainerState.save_to_json
        mark, rmtree = ckpt_lib.mark_complete, checkpoints.shutil.rmtree
        killer = self

        def torch_save(obj, f, *args, **kwargs):
            if isinstance(f, str | os.PathLike):
                buffer = io.BytesIO()
                save(obj, buffer, *args, **kwargs)
                killer.event(str(f), buffer.getvalue())
            return save(obj, f, *args, **kwargs)

        def safetensors_save(tensors, filename, *args, **kwargs):
            killer.event()
            return save_file(tensors, filename, *args, **kwargs)

        def save_to_json(state, path):
            killer.event()
            return to_json(state, path)

        def mark_complete(path, **info):
            killer.event()
            return mark(path, **info)

        def remove_tree(path, *args, **kwargs):
            killer.event()
            return rmtree(path, *args, **kwargs)

        torch.save = torch_save
        safetensors.torch.save_file = safetensors_save
        cb.TrainerState.save_to_json = save_to_json
        checkpoints.mark_complete = mark_complete
        import shutil

        shutil.rmtree = remove_tree


# ---------------------------------------------------------------------------------------------- one run
def run(out_dir: str, ranks: int, resume: bool, kill_at: int, tear: bool, report: str) -> None:
    """One training run in this (forked) process; writes {losses, resumed_from, events, params} to `report`."""
    torch.set_num_threads(1)
    from transformers import Trainer, TrainingArguments

    killer = Killer(kill_at, tear)
    killer.install()
    common = dict(output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-2,
                  logging_steps=1, save_steps=1, save_total_limit=2, report_to="none", disable_tqdm=True,
                  seed=0, dataloader_pin_memory=False, use_cpu=True)
    if ranks == 1:
        trainer_cls, args = Trainer, TrainingArguments(**common)
    else:
        trainer_cls = mindspeed_hf.MindSpeedTrainer
        args = mindspeed_hf.MindSpeedTrainingArguments(**common, mindspeed_dp_shard=ranks)
    trainer = trainer_cls(model=tiny_model(), args=args, train_dataset=dataset(), data_collator=collate)
    losses: dict[int, float] = {}
    compute = trainer.compute_loss

    def compute_loss(*a, **k):
        loss = compute(*a, **k)
        losses[trainer.state.global_step + 1] = float(loss.detach())
        return loss

    trainer.compute_loss = compute_loss
    target = checkpoints.resolve_resume(trainer, True) if resume else None
    trainer.train(resume_from_checkpoint=target)
    from torch.distributed.tensor import DTensor

    digest = sum(float((p.full_tensor() if isinstance(p, DTensor) else p).detach().double().sum())
                 for p in trainer.model.parameters())
    if int(os.environ.get("RANK", "0")) == 0:
        with open(report, "w") as f:
            json.dump({"losses": losses, "resumed_from": target and os.path.basename(target),
                       "events": killer.count, "params": digest}, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out_dir: str, ranks: int, resume: bool = False, kill_at: int = 0, tear: bool = False,
           delay: float | None = None, victim: int = 0) -> dict | None:
    """Fork `ranks` processes for one run (torchrun's variables); SIGKILL after `delay` s if given. Returns the
    report of a run that finished, None for a killed one. `victim`: the rank the delay kills."""
    report = os.path.join(out_dir, f"report-{time.monotonic_ns()}.json")
    port, pids = _free_port(), []
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                if ranks > 1:
                    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                                      LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                run(out_dir, ranks, resume, kill_at if rank == 0 else 0, tear, report)  # rank 0 writes most
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    deadline = None if delay is None else time.monotonic() + delay
    statuses = {}
    while len(statuses) < len(pids):
        for pid in pids:
            if pid in statuses:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                statuses[pid] = status
        if deadline is not None and time.monotonic() >= deadline:
            deadline = None
            os.kill(pids[victim], signal.SIGKILL)
        if statuses and any(os.WIFSIGNALED(s) or os.WEXITSTATUS(s) for s in statuses.values()):
            for pid in pids:  # torchrun's behaviour: one rank gone, the rest are stopped
                if pid not in statuses:
                    os.kill(pid, signal.SIGKILL)
                    statuses[pid] = os.waitpid(pid, 0)[1]
        time.sleep(0.005)
    if all(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in statuses.values()) and os.path.exists(report):
        with open(report) as f:
            return json.load(f)
    return None


def complete_ones(out_dir: str) -> list[str]:
    """Every checkpoint marked COMPLETE, after checking each reads whole and holds its own step."""
    found = []
    for name in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, name)
        if name.startswith("checkpoint-") and ckpt_lib.is_complete_checkpoint(path):
            problem = unreadable_file(path)
            assert problem is None, f"COMPLETE but unreadable: {problem}"
            with open(os.path.join(path, "trainer_state.json")) as f:
                assert json.load(f)["global_step"] == int(name.split("-")[1]), path
            found.append(name)
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    rng = random.Random(opts.seed)
    root = tempfile.mkdtemp(prefix="crash_")
    started = time.monotonic()
    whole = launch(os.path.join(root, "whole"), opts.ranks)
    assert whole is not None, "the uninterrupted run failed"
    whole_s = time.monotonic() - started
    results = []
    for i in range(opts.iterations):
        out_dir = os.path.join(root, f"run{i}")
        os.makedirs(out_dir)
        injected = i % 3 != 2
        kill = dict(kill_at=rng.randint(1, whole["events"]), tear=rng.random() < 0.5) if injected else \
            dict(delay=rng.uniform(0.3 * whole_s, whole_s), victim=rng.randrange(opts.ranks))
        finished = launch(out_dir, opts.ranks, **kill)
        entry = {"kill": kill, "finished_anyway": finished is not None}
        if finished is None:
            complete = complete_ones(out_dir)
            newest = max(complete, key=lambda n: int(n.split("-")[1]), default=None)
            entry["newest_complete"] = newest
            if newest is not None:
                resumed = launch(out_dir, opts.ranks, resume=True)
                entry["resumed"] = resumed
        results.append(entry)
    print("RESULT " + json.dumps({"whole": whole, "iterations": results, "seconds": time.monotonic() - started}))


if __name__ == "__main__":
    main()
