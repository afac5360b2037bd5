"""Crash-safe checkpoints for every run: runs killed (SIGKILL) at random points of a save resume from the newest
complete checkpoint with the uninterrupted run's losses; a truncated file of each kind is named in one line and the
previous complete checkpoint is taken; save_total_limit never deletes the last complete checkpoint; the command's
resume flag continues a killed run exactly."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from child_runs import REPO, child_env

from mindspeed_hf import checkpoints
from mindspeed_hf.parallel.checkpoint import COMPLETE_MARKER

DRIVER = Path(__file__).with_name("crash_driver.py")


def _drive(ranks: int, iterations: int, seed: int) -> dict:
    proc = subprocess.run([sys.executable, str(DRIVER), "--ranks", str(ranks), "--iterations", str(iterations),
                           "--seed", str(seed)], env=child_env(auto=True), cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    print(f"{ranks} rank(s): {iterations} kills in {result['seconds']:.1f} s")
    return result


@pytest.mark.parametrize("ranks,iterations", [(1, 15), (2, 6)], ids=["one-process", "two-ranks-fsdp2"])
def test_killed_saves_resume_from_the_newest_complete_checkpoint(ranks, iterations):
    result = _drive(ranks, iterations, seed=ranks)
    whole = result["whole"]
    killed = [it for it in result["iterations"] if not it["finished_anyway"]]
    assert len(killed) >= iterations // 2, result["iterations"]  # most kills land inside the run
    assert any(it["kill"].get("tear") for it in killed), "no kill left a half-written file"
    resumed = {"injected": 0, "delay": 0}  # kills at a chosen write (seeded, so the same every run) / after a delay
    for it in killed:  # the driver has checked every COMPLETE checkpoint reads whole and holds its own step
        if it["newest_complete"] is None:  # killed before the first save finished: nothing to resume
            continue
        run = it["resumed"]
        assert run is not None, it
        assert run["resumed_from"] == it["newest_complete"], it
        start = int(run["resumed_from"].split("-")[1])
        if start == len(whole["losses"]):  # killed after its last save: plain HF's resume then runs one more step
            continue
        assert sorted(map(int, run["losses"])) == list(range(start + 1, len(whole["losses"]) + 1)), it
        for step, loss in run["losses"].items():
            assert abs(loss - whole["losses"][step]) <= 1e-6, (step, it)
        assert abs(run["params"] - whole["params"]) <= 1e-9 * abs(whole["params"]), it
        resumed["delay" if "delay" in it["kill"] else "injected"] += 1
    # Where a delay kill lands depends on the machine's speed: only the seeded write kills are counted here (a third
    # of the kills at least must have resumed mid-run); every resume above was checked either way.
    injected = sum("kill_at" in it["kill"] for it in result["iterations"])
    assert resumed["injected"] >= injected // 3, (resumed, result["iterations"])


# ---------------------------------------------------------------------------------------------- truncated files
@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A finished one-process run (plain Trainer, wired): checkpoints 1..3, the newest with every file kind."""
    import torch
    from transformers import Trainer, TrainingArguments

    sys.path.insert(0, str(Path(__file__).parent))
    from crash_driver import collate, dataset, tiny_model

    from mindspeed_hf.trainers import wiring

    wiring.install_trainer_wiring()
    try:
        out = tmp_path_factory.mktemp("saved")
        args = TrainingArguments(output_dir=str(out), max_steps=3, per_device_train_batch_size=2, save_steps=1,
                                 report_to="none", disable_tqdm=True, use_cpu=True, dataloader_pin_memory=False)
        torch.manual_seed(0)
        Trainer(model=tiny_model(), args=args, train_dataset=dataset(), data_collator=collate).train()
    finally:
        wiring.uninstall_trainer_wiring()
    return out


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth",
                                  "trainer_state.json", "training_args.bin"])
def test_a_truncated_file_is_named_and_the_previous_checkpoint_taken(saved_run, tmp_path, caplog, name):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    newest = run / "checkpoint-3"
    assert (newest / COMPLETE_MARKER).is_file() and checkpoints.unreadable_file(str(newest)) is None
    data = (newest / name).read_bytes()
    (newest / name).write_bytes(data[: len(data) * 2 // 3])
    with caplog.at_level(logging.INFO, logger="mindspeed_hf"):
        assert checkpoints.newest_resumable(str(run)) == str(run / "checkpoint-2")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert str(newest / name) in errors[0] and "falling back to the previous complete checkpoint" in errors[0]
    with pytest.raises(checkpoints.CheckpointError, match=rf"{name}: truncated"):  # given by path: refused, named
        checkpoints.check_checkpoint(str(newest), sharded=False)


def test_unfinished_saves_are_skipped_with_the_reason(saved_run, tmp_path, caplog):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    (run / "checkpoint-3" / COMPLETE_MARKER).unlink()  # killed before it was published
    with caplog.at_level(logging.INFO, logger="mindspeed_hf"):
        assert checkpoints.newest_resumable(str(run)) == str(run / "checkpoint-2")
    assert any("skipping" in r.getMessage() and "checkpoint-3" in r.getMessage() and "did not finish"
               in r.getMessage() for r in caplog.records)
    with pytest.raises(checkpoints.CheckpointError, match="valid checkpoint at '.*checkpoint-3': no COMPLETE marker"):
        checkpoints.check_checkpoint(str(run / "checkpoint-3"), sharded=False)  # given by path: refused too
    for path in run.glob("checkpoint-*"):  # every save interrupted
        (path / COMPLETE_MARKER).unlink(missing_ok=True)
        (path / "trainer_state.json").unlink()
    with pytest.raises(checkpoints.CheckpointError, match="no complete checkpoint in output_dir"):
        checkpoints.newest_resumable(str(run))


def test_a_run_written_without_mindspeed_hf_resumes_by_hf_rule(saved_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    for path in run.glob("checkpoint-*"):
        (path / COMPLETE_MARKER).unlink()
    (run / "checkpoint-3" / "trainer_state.json").unlink()  # HF's own "unfinished"
    assert checkpoints.newest_resumable(str(run)) == str(run / "checkpoint-2")
    assert checkpoints.check_checkpoint(str(run / "checkpoint-2"), sharded=False) == str(run / "checkpoint-2")


def test_rotation_never_deletes_the_last_complete_checkpoint(tmp_path):
    """save_total_limit=1 with a stale interrupted save numbered past the current step (a killed run): Trainer's
    rotation runs after the new checkpoint is published, and the stale save does not stand in for "the newest"."""
    import torch
    from transformers import Trainer, TrainingArguments

    sys.path.insert(0, str(Path(__file__).parent))
    from crash_driver import collate, dataset, tiny_model

    from mindspeed_hf.trainers import wiring

    stale = tmp_path / "checkpoint-9"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"torn")
    seen: list[list[str]] = []
    wiring.install_trainer_wiring()
    try:
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, save_steps=1,
                                 save_total_limit=1, report_to="none", disable_tqdm=True, use_cpu=True,
                                 dataloader_pin_memory=False)
        torch.manual_seed(0)
        trainer = Trainer(model=tiny_model(), args=args, train_dataset=dataset(), data_collator=collate)
        original = shutil.rmtree

        def rmtree(path, *a, **k):  # at every deletion, a complete checkpoint must remain
            original(path, *a, **k)
            seen.append(sorted(p.name for p in tmp_path.glob("checkpoint-*") if (p / COMPLETE_MARKER).is_file()))

        shutil.rmtree = rmtree
        try:
            trainer.train()
        finally:
            shutil.rmtree = original
    finally:
        wiring.uninstall_trainer_wiring()
    assert seen and all(seen), seen
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3"]


# ---------------------------------------------------------------------------------------------- the command
def test_command_resume_flag_continues_a_killed_run_exactly(tmp_path):
    cmd = [sys.executable, "-m", "mindspeed_hf.cli.main", "train", "--skip-quality-eval", "--logging_steps", "1",
           "--save_strategy", "steps", "--save_steps", "2", "--max_steps", "8", "--lr_scheduler_type", "constant"]
    env = child_env(auto=True)

    def metrics(out: Path, *extra: str) -> dict:
        file = tmp_path / f"{out.name}-{len(extra)}.json"
        proc = subprocess.run([*cmd, "--output_dir", str(out), "--metrics-file", str(file), *extra], env=env,
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(file.read_text())

    whole = metrics(tmp_path / "whole")
    killed = tmp_path / "killed"
    proc = subprocess.Popen([*cmd, "--output_dir", str(killed)], env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    first = killed / "checkpoint-2" / COMPLETE_MARKER
    deadline = time.monotonic() + 240
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    resumed = metrics(killed, "--resume_from_checkpoint")
    assert resumed["steps"] == 8 and resumed["losses"], resumed
    for step, loss in resumed["losses"].items():
        assert abs(loss - whole["losses"][step]) <= 1e-5, step


def test_a_marker_write_cut_short_leaves_no_marker(tmp_path, monkeypatch):
    """A kill while COMPLETE is being written must not leave an empty marker that reads as "complete" (seen: the
    command's resume then found checkpoint-2 "complete", its marker unreadable, and nothing to resume from)."""
    from mindspeed_hf.parallel import checkpoint as ckpt_lib

    def cut(obj, f):
        f.write(json.dumps(obj)[:5])
        raise KeyboardInterrupt  # stands for the SIGKILL: the process stops mid-write

    monkeypatch.setattr(ckpt_lib.json, "dump", cut)
    with pytest.raises(KeyboardInterrupt):
        ckpt_lib.mark_complete(str(tmp_path), global_step=2)
    assert not ckpt_lib.is_complete_checkpoint(str(tmp_path))
    monkeypatch.undo()
    ckpt_lib.mark_complete(str(tmp_path), global_step=2)
    assert json.loads((tmp_path / COMPLETE_MARKER).read_text())["global_step"] == 2
    ckpt_lib.unmark(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_truncated_dcp_shard_is_named(tmp_path):
    """FSDP2 checkpoints hold DCP shards: a cut shard file (or its .metadata) is named by the same check."""
    import torch
    import torch.distributed.checkpoint as dcp

    shard_dir = tmp_path / "checkpoint-1" / "pytorch_model_fsdp_0"
    dcp.save({"model": {"w": torch.arange(4096, dtype=torch.float32)}}, checkpoint_id=str(shard_dir))
    assert checkpoints.unreadable_file(str(tmp_path / "checkpoint-1")) is None
    shard = next(shard_dir.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    assert checkpoints.unreadable_file(str(tmp_path / "checkpoint-1")).startswith(f"{shard}: truncated")
    (shard_dir / ".metadata").write_bytes((shard_dir / ".metadata").read_bytes()[:20])
    problem = checkpoints.unreadable_file(str(tmp_path / "checkpoint-1"))
    assert problem == f"{shard_dir / '.metadata'}: truncated or corrupt"
