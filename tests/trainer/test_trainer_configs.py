"""The config a trainer (or apply_to_model) was given belongs to that trainer and its model: two trainers with
different settings in one process, and a trained model beside a frozen reference model (as in DPO), each run
with their own settings, and each equals plain Hugging Face."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_wiring import dataset, quick_args, tiny_model
from transformers import Trainer

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.patches import causal_lm, forwards
from mindspeed_hf.runtime import run_of
from mindspeed_hf.trainers import MindSpeedTrainer, MindSpeedTrainingArguments

STEPS = 3


@pytest.fixture
def calls(monkeypatch):
    """Counts of what really runs: the fused RMSNorm forward and add+norm (any backend), the NPU RMSNorm ops (the
    stand-in's npu_rms_norm, and npu_add_rms_norm where the residual add is fused into the norm) and the fused loss."""
    import torch_npu

    counts: Counter = Counter()

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(forwards, "rms_norm", counting("fused rms_norm", forwards.rms_norm))
    monkeypatch.setattr(forwards, "add_rms_norm", counting("fused add_rms_norm", forwards.add_rms_norm))
    monkeypatch.setattr(torch_npu, "npu_rms_norm", counting("npu_rms_norm", torch_npu.npu_rms_norm))
    monkeypatch.setattr(torch_npu, "npu_add_rms_norm", counting("npu_add_rms_norm", torch_npu.npu_add_rms_norm))
    monkeypatch.setattr(causal_lm, "fused_linear_cross_entropy",
                        counting("fused loss", causal_lm.fused_linear_cross_entropy))
    return counts


def _losses(trainer: Trainer) -> list[float]:
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _plain_hf_losses(tmp_path, seed: int, **kw) -> list[float]:
    mindspeed_hf.disable()
    trainer = Trainer(model=tiny_model(seed), args=quick_args(tmp_path / f"hf{seed}", max_steps=STEPS,
                                                              logging_steps=1, **kw), train_dataset=dataset())
    return _losses(trainer)


def _mindspeed_args(tmp_path, name: str, **kw) -> MindSpeedTrainingArguments:
    return quick_args(tmp_path / name, MindSpeedTrainingArguments, max_steps=STEPS, logging_steps=1, **kw)


def test_two_trainers_keep_their_own_settings(tmp_path, calls):
    reference_a = _plain_hf_losses(tmp_path, seed=0)
    reference_b = _plain_hf_losses(tmp_path, seed=1, gradient_checkpointing=True,
                                   gradient_checkpointing_kwargs={"use_reentrant": False})
    mindspeed_hf.enable()
    a = MindSpeedTrainer(model=tiny_model(0), args=_mindspeed_args(tmp_path, "a", mindspeed_backend="npu"),
                         train_dataset=dataset())
    # Built second, with every setting a differs in: before, the last trainer built switched the whole process.
    b = MindSpeedTrainer(model=tiny_model(1), args=_mindspeed_args(
        tmp_path, "b", mindspeed_backend="torch", mindspeed_rms_norm=False, mindspeed_fused_linear_cross_entropy=False,
        mindspeed_recompute=True), train_dataset=dataset())
    assert a.mindspeed_report["backend"] == "npu" and b.mindspeed_report["backend"] == "torch"
    assert a.mindspeed_report["kernels"]["rms_norm"] == 9 and b.mindspeed_report["kernels"]["rms_norm"] == 0

    losses_a = _losses(a)
    norms = calls["npu_rms_norm"] + calls["npu_add_rms_norm"]
    assert norms == STEPS * 9 and calls["fused loss"] == STEPS  # 9 norms per forward
    calls.clear()
    losses_b = _losses(b)  # recompute reruns b's layers in backward: still b's settings there
    assert calls == Counter(), f"b ran kernels it switched off: {dict(calls)}"

    assert losses_a == pytest.approx(reference_a, abs=1e-5)
    assert losses_b == pytest.approx(reference_b, abs=1e-5)
    assert mindspeed_hf.get_config() == mindspeed_hf.load_config()  # the process config is untouched


class _WithFrozenReference(Trainer):
    """A DPO-shaped step: the trained model's loss, plus a forward of a frozen reference model."""

    reference: torch.nn.Module
    reference_logits: list[torch.Tensor]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with torch.no_grad():
            self.reference_logits.append(self.reference(input_ids=inputs["input_ids"]).logits)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def _run_with_reference(tmp_path, name: str, accelerated: bool):
    policy, reference = tiny_model(0), tiny_model(7).eval().requires_grad_(False)
    if accelerated:
        mindspeed_hf.apply_to_model(reference, config_from_dict({"backend": "npu", "kernels": {"rope": False}}))
    trainer = _WithFrozenReference(model=policy, args=quick_args(tmp_path / name, max_steps=STEPS, logging_steps=1),
                                   train_dataset=dataset())
    trainer.reference, trainer.reference_logits = reference, []
    return _losses(trainer), trainer


def test_trained_model_and_frozen_reference_keep_their_own_settings(tmp_path, calls):
    mindspeed_hf.disable()
    hf_losses, hf = _run_with_reference(tmp_path, "hf", accelerated=False)
    mindspeed_hf.enable(config_from_dict({"backend": "torch"}))  # the policy: the process config, torch backend
    losses, ours = _run_with_reference(tmp_path, "ours", accelerated=True)
    assert run_of(ours).report["backend"] == "torch"
    assert mindspeed_hf.report(ours.reference)["backend"] == "npu"
    assert mindspeed_hf.report(ours.reference)["kernels"]["rope"] == 0
    # npu RMSNorm ran for the reference forwards only (9 norms each); the policy ran the torch kernel
    assert calls["npu_rms_norm"] + calls["npu_add_rms_norm"] == 9 * STEPS
    assert calls["fused rms_norm"] > calls["npu_rms_norm"]
    assert calls["fused loss"] == STEPS
    assert losses == pytest.approx(hf_losses, abs=1e-5)
    for mine, theirs in zip(ours.reference_logits, hf.reference_logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
