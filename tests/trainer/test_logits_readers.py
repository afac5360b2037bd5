"""Logits for whoever reads them: the fused loss skips the [tokens, vocab] logits where nothing can read them
(Trainer's own loss computation) and makes them on first read elsewhere, and everybody - PEFT prompt learning, a
compute_loss that reads outputs.logits, a compute_loss_func, evaluation with predictions - gets the same logits and
losses as plain HF."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_wiring import dataset, quick_args, tiny_model
from transformers import Trainer

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.patches import causal_lm
from mindspeed_hf.runtime import run_of

STEPS = 3


@pytest.fixture
def fused_calls(monkeypatch) -> Counter:
    counts: Counter = Counter()
    original = causal_lm.fused_linear_cross_entropy

    def counting(*args, **kwargs):
        counts["fused"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(causal_lm, "fused_linear_cross_entropy", counting)
    return counts


def _losses(tmp_path, name: str, model_fn, accelerated: bool, trainer_cls=Trainer, trainer_kw=None, **kw):
    if accelerated:
        mindspeed_hf.enable()
    else:
        mindspeed_hf.disable()
    trainer = trainer_cls(model=model_fn(), args=quick_args(tmp_path / name, max_steps=STEPS, logging_steps=1, **kw),
                          train_dataset=dataset(), **(trainer_kw or {}))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


def _compare(tmp_path, model_fn, **kw):
    hf, _ = _losses(tmp_path, "hf", model_fn, accelerated=False, **kw)
    ours, trainer = _losses(tmp_path, "ours", model_fn, accelerated=True, **kw)
    assert ours == pytest.approx(hf, abs=1e-5)
    return trainer


def _prompt_learning(method: str):
    def build():
        from peft import CPTConfig, PrefixTuningConfig, PromptTuningConfig, get_peft_model

        config = {"cpt": CPTConfig(task_type="CAUSAL_LM", cpt_token_ids=[5, 6, 7, 8], cpt_mask=[1, 1, 1, 1],
                                   cpt_tokens_type_mask=[1, 2, 2, 2]),
                  "prefix": PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
                  "prompt": PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)}[method]
        model = tiny_model()
        torch.manual_seed(1)
        return get_peft_model(model, config)

    return build


@pytest.mark.parametrize("method", ["cpt", "prefix", "prompt"])
def test_peft_prompt_learning_matches_hf(method, tmp_path):
    _compare(tmp_path, _prompt_learning(method), learning_rate=1e-2)


class _ReadsLogits(Trainer):
    """A compute_loss that adds a term computed from outputs.logits (labels passed to the model)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        loss = outputs.loss + 1e-2 * outputs.logits.float().logsumexp(-1).pow(2).mean()
        return (loss, outputs) if return_outputs else loss


def test_compute_loss_reading_logits_matches_hf(tmp_path, fused_calls):
    _compare(tmp_path, tiny_model, trainer_cls=_ReadsLogits)
    # the loss is the fused one; the logits it reads were made on that read (tests/models/test_lazy_logits.py)
    assert fused_calls["fused"] == STEPS


def _loss_from_logits(outputs, labels, num_items_in_batch=None):
    logits = outputs.logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                             reduction="sum") / num_items_in_batch


def test_compute_loss_func_matches_hf(tmp_path):
    _compare(tmp_path, tiny_model, trainer_kw={"compute_loss_func": _loss_from_logits})


def test_predictions_match_hf(tmp_path):
    predictions = []
    for accelerated in (False, True):
        _, trainer = _losses(tmp_path, f"p{accelerated}", tiny_model, accelerated, prediction_loss_only=False)
        predictions.append(trainer.predict(dataset(8)))
    torch.testing.assert_close(torch.as_tensor(predictions[1].predictions), torch.as_tensor(predictions[0].predictions),
                               atol=1e-5, rtol=0)
    assert predictions[1].metrics["test_loss"] == pytest.approx(predictions[0].metrics["test_loss"], abs=1e-5)


def test_plain_trainer_and_lora_still_skip_the_logits(tmp_path, fused_calls):
    _compare(tmp_path, tiny_model)
    assert fused_calls["fused"] == STEPS

    def lora():
        from peft import LoraConfig, get_peft_model

        return get_peft_model(tiny_model(), LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))

    fused_calls.clear()
    _compare(tmp_path, lora)
    assert fused_calls["fused"] == STEPS


def test_always_names_the_setting_when_logits_are_read(tmp_path):
    mindspeed_hf.enable(config_from_dict({"kernels": {"skip_logits": "always"}}))
    trainer = _ReadsLogits(model=tiny_model(), args=quick_args(tmp_path, max_steps=1), train_dataset=dataset())
    assert run_of(trainer).report["skip_logits"] == "always"
    with pytest.raises(RuntimeError, match=r"kernels.skip_logits=always.*set kernels.skip_logits to auto"):
        trainer.train()


def test_never_keeps_the_logits_and_report_says_which_applies(tmp_path, fused_calls):
    mindspeed_hf.enable(config_from_dict({"kernels": {"skip_logits": "never"}}))
    trainer = Trainer(model=tiny_model(), args=quick_args(tmp_path, max_steps=1), train_dataset=dataset())
    assert run_of(trainer).report["skip_logits"] == "never"
    trainer.train()
    assert fused_calls["fused"] == 0
    mindspeed_hf.enable()
    assert mindspeed_hf.report(tiny_model())["skip_logits"] == "auto"
