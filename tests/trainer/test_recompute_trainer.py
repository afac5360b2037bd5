"""Recompute through Trainer: MindSpeedTrainingArguments, a plain Trainer configured by MINDSPEED_HF_CONFIG, and HF's
own gradient_checkpointing=True taken as full. Trained weights are bitwise equal to the same run without recompute."""

from __future__ import annotations

import torch
from test_wiring import dataset, quick_args, tiny_model
from transformers import Trainer

import mindspeed_hf
from mindspeed_hf.memory.recompute import decoder_layers
from mindspeed_hf.memory.selective import is_wrapped
from mindspeed_hf.releases.compat import training_args_checkpointing_names
from mindspeed_hf.runtime import run_of
from mindspeed_hf.trainers import MindSpeedTrainer, MindSpeedTrainingArguments

SWITCH = training_args_checkpointing_names()[0]


def _trained(trainer: Trainer) -> dict[str, torch.Tensor]:
    trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _assert_bitwise(expected: dict, actual: dict) -> None:
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[n], actual[n]) for n in expected)


def _model():
    model = tiny_model()
    # transformers 4.57 builds a KV cache in training forwards unless whole-layer checkpointing turns it off,
    # and its mask path with a cache differs in the last bit: compare like with like.
    model.config.use_cache = False
    return model


def _plain(tmp_path, name: str, **kw) -> Trainer:
    return Trainer(model=_model(), args=quick_args(tmp_path / name, learning_rate=1e-2, **kw), train_dataset=dataset())


def test_mindspeed_arguments_selective_and_full(tmp_path):
    def run(name, **kw):
        args = quick_args(tmp_path / name, MindSpeedTrainingArguments, learning_rate=1e-2, **kw)
        trainer = MindSpeedTrainer(model=_model(), args=args, train_dataset=dataset())
        return trainer, _trained(trainer)

    _, expected = run("none")
    trainer, selective = run("selective", mindspeed_recompute="selective", mindspeed_recompute_layers=[1])
    assert [is_wrapped(layer.mlp) for layer in decoder_layers(trainer.model)] == [False, True]
    _assert_bitwise(expected, selective)
    trainer, full = run("full", mindspeed_recompute="full")
    assert all(layer.gradient_checkpointing for layer in decoder_layers(trainer.model))
    _assert_bitwise(expected, full)


def configured_plain(tmp_path, monkeypatch, memory_yaml: str) -> tuple[dict[str, torch.Tensor], Trainer]:
    """(weights a plain Trainer trains without mindspeed_hf memory settings, a plain Trainer configured by a
    MINDSPEED_HF_CONFIG file holding `memory: <memory_yaml>`)."""
    mindspeed_hf.enable()
    expected = _trained(_plain(tmp_path, "none"))
    config = tmp_path / "memory.yaml"
    config.write_text(f"memory: {memory_yaml}\n")
    monkeypatch.setenv("MINDSPEED_HF_CONFIG", str(config))
    return expected, _plain(tmp_path, "configured")


def test_plain_trainer_with_config_file(tmp_path, monkeypatch):
    expected, trainer = configured_plain(
        tmp_path, monkeypatch, "{recompute: selective, recompute_modules: [self_attn, norms], recompute_layers: 2}")
    layers = decoder_layers(trainer.model)
    assert [is_wrapped(layer.self_attn) for layer in layers] == [True, False]
    assert is_wrapped(layers[0].input_layernorm) and not is_wrapped(layers[0].mlp)
    _assert_bitwise(expected, _trained(trainer))


def test_hf_gradient_checkpointing_is_full_unless_the_config_says_otherwise(tmp_path, monkeypatch):
    mindspeed_hf.enable()
    expected = _trained(_plain(tmp_path, "none"))
    trainer = _plain(tmp_path, "hf_full", **{SWITCH: True})
    assert run_of(trainer).config.memory.recompute_mode == "full"
    assert getattr(trainer.args, SWITCH) is True  # the arguments stay as written (they are saved in checkpoints)
    assert all(layer.gradient_checkpointing for layer in decoder_layers(trainer.model))
    _assert_bitwise(expected, _trained(trainer))

    # A trainer that switches checkpointing off around a no-grad forward and back on (TRL's DPO, every step) gets
    # ours back (before: the switch-on was swallowed and whole-layer recompute stayed off for good)
    model = trainer.model
    model.gradient_checkpointing_disable()
    assert not any(layer.gradient_checkpointing for layer in decoder_layers(model))
    model.gradient_checkpointing_enable({"use_reentrant": True})
    layers = decoder_layers(model)
    assert all(layer.gradient_checkpointing for layer in layers)
    # non-reentrant (ours), not the caller's kwargs: the layer's checkpoint function is bound with use_reentrant=False
    assert layers[0]._gradient_checkpointing_func.keywords.get("use_reentrant") is False

    monkeypatch.setenv("MINDSPEED_HF_MEMORY_RECOMPUTE", "false")  # a source that sets it wins, even to the default
    trainer = _plain(tmp_path, "env_off", **{SWITCH: True})
    assert run_of(trainer).config.memory.recompute_mode == "off"
    assert run_of(trainer).resolved.sources["memory.recompute"] == "environment (MINDSPEED_HF_*)"

    monkeypatch.setenv("MINDSPEED_HF_MEMORY_RECOMPUTE", "selective")  # a source that sets it wins
    trainer = _plain(tmp_path, "env_selective", **{SWITCH: True})
    assert run_of(trainer).config.memory.recompute_mode == "selective"
    parameters = _trained(trainer)
    assert not any(layer.gradient_checkpointing for layer in decoder_layers(trainer.model))
    assert all(is_wrapped(layer.mlp) for layer in decoder_layers(trainer.model))
    _assert_bitwise(expected, parameters)
