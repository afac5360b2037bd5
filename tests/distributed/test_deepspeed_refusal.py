"""DeepSpeed together with mindspeed_hf's own parallelism (FSDP2 from Trainer's fsdp arguments or our dp_shard /
dp_replicate, context parallelism, expert parallelism) is refused when the TrainingArguments are created, before
anything is set up, with one line that names both sides and what to drop; and again in the trainer's setup for a
config given later. In-process, no launcher: the refusal comes before accelerate's device setup, so nothing of it
is left behind. The DeepSpeed runs themselves: test_deepspeed.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import transformers
from packaging.version import Version

import mindspeed_hf
from mindspeed_hf.config import Layer, MindSpeedConfig, ParallelConfig, resolve
from mindspeed_hf.trainers import deepspeed as ds
from mindspeed_hf.trainers.lifecycle import start

DS_CONFIG = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3}}
NEEDS_5 = pytest.mark.skipif(Version(transformers.__version__) < Version("5.0"),
                             reason="expert parallelism needs transformers >= 5 (refused on its own before)")


@pytest.fixture
def wired():
    mindspeed_hf.enable()  # installs the TrainingArguments hook (the autouse fixture disables it afterwards)


def _refused(make, *fragments: str) -> str:
    with pytest.raises(ValueError) as caught:
        make()
    line = str(caught.value)
    assert "\n" not in line, line
    for fragment in ("DeepSpeed", "drop one", *fragments):
        assert fragment in line, (fragment, line)
    return line


def test_with_trainer_fsdp(wired, tmp_path):
    from transformers import TrainingArguments

    _refused(lambda: TrainingArguments(output_dir=str(tmp_path), deepspeed=DS_CONFIG, fsdp="full_shard",
                                       fsdp_config={"fsdp_version": 2}), "TrainingArguments.fsdp",
             "TrainingArguments.deepspeed")


@pytest.mark.parametrize("field, value, named", [
    ("mindspeed_dp_shard", 2, "FSDP2 (mindspeed_dp_shard=2"),
    ("mindspeed_dp_replicate", 2, "FSDP2 (mindspeed_dp_replicate=2"),
    ("mindspeed_cp", 2, "context parallelism (mindspeed_cp=2"),
    pytest.param("mindspeed_ep", 2, "expert parallelism (mindspeed_ep=2", marks=NEEDS_5),
])
def test_with_our_sizes_in_the_arguments(field, value, named, tmp_path):
    """MindSpeedTrainingArguments refuse on their own (also without the wiring: MINDSPEED_HF_AUTO=0)."""
    from mindspeed_hf import MindSpeedTrainingArguments

    _refused(lambda: MindSpeedTrainingArguments(output_dir=str(tmp_path), deepspeed=DS_CONFIG, **{field: value}),
             named)


def test_with_our_sizes_from_the_environment(wired, tmp_path, monkeypatch):
    from transformers import TrainingArguments

    monkeypatch.setenv("MINDSPEED_HF_PARALLEL_DP_SHARD", "2")
    _refused(lambda: TrainingArguments(output_dir=str(tmp_path), deepspeed=DS_CONFIG), "MINDSPEED_HF_PARALLEL_DP_SHARD")


def test_accelerate_launch_deepspeed_with_accelerate_fsdp(monkeypatch):
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_USE_FSDP": "true"}
    _refused(lambda: ds.check_exclusive(SimpleNamespace(deepspeed=None, fsdp=None), env=env),
             ds.ENV_SOURCE, "ACCELERATE_USE_FSDP")


def test_config_given_later_is_refused_in_the_trainer_setup():
    """enable(config) after the arguments were made: the trainer's setup refuses before Trainer.__init__."""
    mindspeed_hf.enable(MindSpeedConfig(parallel=ParallelConfig(cp=2)))
    args = SimpleNamespace(deepspeed=DS_CONFIG, fsdp=None)
    _refused(lambda: start(SimpleNamespace(), args), "context parallelism")


def test_deepspeed_alone_or_ours_alone_is_accepted():
    resolved = mindspeed_hf.runtime.resolve_config(None)
    ds.check_exclusive(SimpleNamespace(deepspeed=DS_CONFIG, fsdp=None), resolved, env={})
    ds.check_exclusive(SimpleNamespace(deepspeed=None, fsdp="full_shard"), resolved, env={})
    # dp_shard stated as 1 (and dp_replicate 1): nothing to shard, so nothing that competes with DeepSpeed
    one = resolve([Layer("test", {"parallel.dp_shard": 1, "parallel.dp_replicate": 1})])
    ds.check_exclusive(SimpleNamespace(deepspeed=DS_CONFIG, fsdp=None), one, env={})
    everything = resolve([Layer("test", {"parallel.dp_shard": -1})])
    _refused(lambda: ds.check_exclusive(SimpleNamespace(deepspeed=DS_CONFIG, fsdp=None), everything, env={}),
             "FSDP2 (parallel.dp_shard=-1")
    assert ds.requested(SimpleNamespace(deepspeed=None), env={}) is None
    assert ds.requested(SimpleNamespace(deepspeed="ds.json"), env={}) == ds.ARGUMENT_SOURCE
    assert ds.requested(SimpleNamespace(deepspeed=None), env={"ACCELERATE_USE_DEEPSPEED": "true"}) == ds.ENV_SOURCE


@pytest.mark.parametrize("device, world, use_cpu, expected", [
    ("cpu", "2", False, True), ("cpu", "1", False, False), ("cpu", "2", True, True), ("cuda", "2", False, False)])
def test_cpu_launch_gets_use_cpu(device, world, use_cpu, expected, monkeypatch):
    monkeypatch.setattr(ds, "detect_device_type", lambda: device)
    args = SimpleNamespace(deepspeed=DS_CONFIG, fsdp=None, use_cpu=use_cpu)
    ds.before_arguments(args, env={"WORLD_SIZE": world})
    assert args.use_cpu is expected
