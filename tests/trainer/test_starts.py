"""How a Trainer run starts in its output_dir (trainers/starting.py), in one process with a plain Trainer (wired):

- a new run into an output_dir holding another run's checkpoints stops before any step with one line giving the ways
  forward, every file left byte-identical; runs of one process into one directory (transformers' own tests train
  twice into one directory) go on; with checkpoints.overwrite the other run's checkpoints go first and the directory
  holds one run's;
- a restarted attempt (TORCHELASTIC_RESTART_COUNT / SLURM_RESTART_COUNT > 0) resumes by itself from the newest
  complete checkpoint that reads and ends with the uninterrupted run's weights; an explicit resume argument wins;
  a corrupt newest checkpoint is passed over, naming its file;
- a full disk during a save: one line naming the file and the newest complete checkpoint, nothing complete lost,
  and the next start resumes exactly.
(The same under torchrun, with real restarts and FSDP2: tests/distributed/test_faults.py.)"""

from __future__ import annotations

import errno
import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from crash_driver import collate, dataset, tiny_model  # noqa: E402

import mindspeed_hf  # noqa: E402
from mindspeed_hf import checkpoints  # noqa: E402
from mindspeed_hf.parallel.checkpoint import COMPLETE_MARKER, is_complete_checkpoint  # noqa: E402
from mindspeed_hf.trainers import starting, wiring  # noqa: E402


@pytest.fixture(autouse=True)
def wired(monkeypatch):
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(starting, "_STARTED", set())
    wiring.install_trainer_wiring()
    yield
    wiring.uninstall_trainer_wiring()


def _trainer(out: Path, steps: int = 4, lr: float = 1e-2, stop_at: int | None = None, save_steps: int = 2):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Crash(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == stop_at:
                raise RuntimeError("killed")

    common = dict(output_dir=str(out), max_steps=steps, per_device_train_batch_size=2, learning_rate=lr,
                  save_steps=save_steps, report_to="none", disable_tqdm=True, use_cpu=True, seed=0,
                  dataloader_pin_memory=False, logging_steps=1)
    trainer = Trainer(model=tiny_model(), args=TrainingArguments(**common), train_dataset=dataset(),
                      data_collator=collate, callbacks=[Crash()] if stop_at else None)
    trainer.steps_run = []
    compute = trainer.compute_loss

    def compute_loss(*a, **k):
        trainer.steps_run.append(trainer.state.global_step + 1)
        return compute(*a, **k)

    trainer.compute_loss = compute_loss
    return trainer


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _params(trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).norm() / b.norm()) <= 1e-6


# ---------------------------------------------------------------------------------------------- a new run
def test_a_new_run_over_another_runs_checkpoints_stops_before_any_step(tmp_path, monkeypatch):
    _trainer(tmp_path, steps=4).train()  # run 1: checkpoint-2, checkpoint-4
    before = _files(tmp_path)
    monkeypatch.setattr(starting, "_STARTED", set())  # a new process: run 1 is another run's
    second = _trainer(tmp_path, steps=2, lr=1e-3)
    with pytest.raises(checkpoints.CheckpointError) as caught:
        second.train()
    text = str(caught.value)
    assert "\n" not in text and text.startswith(f"output_dir {tmp_path} holds another run's checkpoints "
                                                "(checkpoint-4, checkpoint-2; the newest at step 4)"), text
    for way in ("resume_from_checkpoint=True", "a new output_dir", "checkpoints.overwrite=true",
                "MINDSPEED_HF_CHECKPOINTS_OVERWRITE=1"):
        assert way in text, way
    assert getattr(caught.value, "_mindspeed_one_line", None) == "rank 0"  # one line if nobody catches it
    assert second.steps_run == [] and _files(tmp_path) == before  # no step, every file byte-identical
    resumed = _trainer(tmp_path, steps=6)  # resuming it is one of the ways forward
    resumed.train(resume_from_checkpoint=True)
    assert resumed.steps_run == [5, 6]


def test_runs_of_one_process_into_one_directory_go_on(tmp_path):
    """transformers' own tests train again into the directory they trained in (test_can_resume_training, ...)."""
    _trainer(tmp_path, steps=2).train()
    again = _trainer(tmp_path, steps=2)
    again.train()
    assert again.steps_run == [1, 2]
    unwritten = tmp_path / "fresh"  # a directory with nothing of another run: nothing to refuse
    assert _trainer(unwritten, steps=2).train().global_step == 2


def test_overwrite_replaces_the_other_run(tmp_path, monkeypatch, caplog):
    _trainer(tmp_path, steps=4).train()
    monkeypatch.setattr(starting, "_STARTED", set())
    monkeypatch.setenv("MINDSPEED_HF_CHECKPOINTS_OVERWRITE", "1")
    second = _trainer(tmp_path, steps=2, lr=1e-3)
    with caplog.at_level(logging.INFO, logger="mindspeed_hf"):
        second.train()
    assert any(r.getMessage() == f"mindspeed_hf: checkpoints.overwrite: removing the earlier run's checkpoint-4, "
               f"checkpoint-2 from {tmp_path}" for r in caplog.records)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]  # one run's: run 2's
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "checkpoint-2" / "model.safetensors")
    model = second.model.state_dict()
    assert all(torch.equal(saved[k], model[k]) for k in saved)


# ---------------------------------------------------------------------------------------------- restarts
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    wiring.install_trainer_wiring()
    try:
        trainer = _trainer(tmp_path_factory.mktemp("whole"), steps=4, save_steps=1)
        trainer.train()
    finally:
        wiring.uninstall_trainer_wiring()
    return _params(trainer)


def _killed_at_step_3(out: Path) -> None:
    with pytest.raises(RuntimeError, match="killed"):
        _trainer(out, steps=4, stop_at=3, save_steps=1).train()
    assert [Path(p).name for p in checkpoints.complete_checkpoints(str(out))] == ["checkpoint-2", "checkpoint-1"]


def test_transformers_4_overwrite_output_dir_is_the_opt_in(tmp_path, monkeypatch):
    """transformers 4.x's own `overwrite_output_dir=True` means the same as checkpoints.overwrite (5.x removed it)."""
    import dataclasses

    from transformers import TrainingArguments

    if "overwrite_output_dir" not in {f.name for f in dataclasses.fields(TrainingArguments)}:
        pytest.skip("transformers >= 5 has no overwrite_output_dir")
    _trainer(tmp_path, steps=2).train()
    monkeypatch.setattr(starting, "_STARTED", set())
    second = _trainer(tmp_path, steps=2)
    second.args.overwrite_output_dir = True
    second.train()
    assert second.steps_run == [1, 2]


def test_the_setting_and_the_launchers_are_read():
    from mindspeed_hf.runtime import elastic

    args = mindspeed_hf.MindSpeedTrainingArguments(output_dir="x", mindspeed_overwrite=True, use_cpu=True)
    assert args.mindspeed_config().checkpoints.overwrite is True
    assert elastic.restart({}) is None and elastic.restart({"TORCHELASTIC_RESTART_COUNT": "0"}) is None
    assert str(elastic.restart({"SLURM_RESTART_COUNT": "2"})) == "SLURM requeue 2 (SLURM_RESTART_COUNT=2)"
    assert str(elastic.restart({"TORCHELASTIC_RESTART_COUNT": "1", "SLURM_RESTART_COUNT": "3"})).startswith(
        "torchrun restart 1 ")


def test_a_restart_resumes_by_itself_to_the_uninterrupted_weights(tmp_path, monkeypatch, caplog, uninterrupted):
    variable, said = "TORCHELASTIC_RESTART_COUNT", "torchrun restart 1"
    _killed_at_step_3(tmp_path)
    monkeypatch.setenv(variable, "1")
    restarted = _trainer(tmp_path, steps=4, save_steps=1)
    with caplog.at_level(logging.INFO, logger="mindspeed_hf"):
        restarted.train()  # no resume argument, as most scripts
    lines = [r.getMessage() for r in caplog.records if "resuming" in r.getMessage()]
    assert lines == [f"mindspeed_hf: {said} ({variable}=1): resuming from {tmp_path / 'checkpoint-2'} (step 2)"]
    assert restarted.steps_run == [3, 4] and _close(_params(restarted), uninterrupted)


def test_an_explicit_resume_wins_and_a_first_attempt_is_left_alone(tmp_path, monkeypatch, caplog):
    _killed_at_step_3(tmp_path)
    first = _trainer(tmp_path, steps=2, save_steps=1)  # count 0: a new run (this process's directory: allowed)
    first.train()
    assert first.steps_run == [1, 2]
    _killed_at_step_3(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    chosen = _trainer(tmp_path, steps=4, save_steps=1)
    with caplog.at_level(logging.INFO, logger="mindspeed_hf"):
        chosen.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert chosen.steps_run == [2, 3, 4]
    assert f"mindspeed_hf: resuming from {tmp_path / 'checkpoint-1'} (step 1)" in [r.getMessage() for r in
                                                                                  caplog.records]
    over = _trainer(tmp_path, steps=2, save_steps=1)
    over.train(resume_from_checkpoint=False)  # explicitly not resuming: starts over, also on a restart
    assert over.steps_run == [1, 2]


def test_a_restart_passes_over_a_corrupt_newest_checkpoint(tmp_path, monkeypatch, caplog):
    _killed_at_step_3(tmp_path)
    weights = tmp_path / "checkpoint-2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = _trainer(tmp_path, steps=4, save_steps=1)
    with caplog.at_level(logging.INFO, logger="mindspeed_hf"):
        restarted.train()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and str(weights) in errors[0] and "falling back" in errors[0], errors
    assert restarted.steps_run == [2, 3, 4]


def test_a_full_disk_during_a_save_loses_nothing(tmp_path, monkeypatch, uninterrupted):
    save = torch.save

    def torch_save(obj, f, *args, **kwargs):
        if str(f).endswith(f"checkpoint-3{'/'}optimizer.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", torch_save)
    with pytest.raises(OSError) as caught:
        _trainer(tmp_path, steps=4, save_steps=1).train()
    text = str(caught.value)
    assert "\n" not in text and text.startswith(f"saving checkpoint {tmp_path / 'checkpoint-3'} failed writing "
                                                f"{tmp_path / 'checkpoint-3' / 'optimizer.pt'}: No space left on "
                                                "device;"), text
    assert "the newest complete one is checkpoint-2" in text and "resume_from_checkpoint=True" in text
    assert caught.value.errno == errno.ENOSPC and caught.value._mindspeed_one_line == "every rank"
    monkeypatch.setattr(torch, "save", save)
    for step in (1, 2):  # nothing complete lost (rotation never ran past a failed save)
        assert checkpoints.unreadable_file(str(tmp_path / f"checkpoint-{step}")) is None
    assert not (tmp_path / "checkpoint-3" / COMPLETE_MARKER).exists()
    assert not is_complete_checkpoint(str(tmp_path / "checkpoint-3"))
    resumed = _trainer(tmp_path, steps=4, save_steps=1)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.steps_run == [3, 4] and _close(_params(resumed), uninterrupted)
