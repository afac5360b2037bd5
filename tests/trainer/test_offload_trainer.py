"""Activation offload through Trainer: MindSpeedTrainingArguments (with gradient accumulation) and a plain Trainer
configured by MINDSPEED_HF_CONFIG get it from the setting; trained weights are bitwise equal to the same run without
it."""

from __future__ import annotations

from test_recompute_trainer import _assert_bitwise, _model, _trained, configured_plain
from test_wiring import dataset, quick_args

from mindspeed_hf.memory import offloader_of
from mindspeed_hf.trainers import MindSpeedTrainer, MindSpeedTrainingArguments


def test_mindspeed_arguments_with_gradient_accumulation(tmp_path):
    def run(name, **kw):
        args = quick_args(tmp_path / name, MindSpeedTrainingArguments, learning_rate=1e-2,
                          gradient_accumulation_steps=2, per_device_train_batch_size=2, **kw)
        trainer = MindSpeedTrainer(model=_model(), args=args, train_dataset=dataset())
        return trainer, _trained(trainer)

    _, expected = run("none")
    trainer, offloaded = run("offload", mindspeed_offload_activations=True, mindspeed_offload_min_bytes=0)
    offloader = offloader_of(trainer.model)
    assert offloader.peak_offloaded_bytes > 0 and offloader.live_entries() == 0
    (pool,) = offloader.pools.values()
    assert pool.reused >= 3 * pool.allocated  # 4 micro-batches, buffers allocated once
    _assert_bitwise(expected, offloaded)


def test_plain_trainer_with_config_file_and_full_recompute(tmp_path, monkeypatch):
    expected, trainer = configured_plain(
        tmp_path, monkeypatch, "{recompute: full, offload_activations: true, offload_min_bytes: 0}")
    assert offloader_of(trainer.model) is not None
    _assert_bitwise(expected, _trained(trainer))
