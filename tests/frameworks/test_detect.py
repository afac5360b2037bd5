"""mindspeed_hf.trainers.frameworks: which framework drives a Trainer and which foreign kernels replaced ours on
its model. Runs without any framework installed: stand-in classes carry the frameworks' module names."""

from __future__ import annotations

import types

import pytest
from torch import nn

from mindspeed_hf.trainers import frameworks


def _cls(name: str, module: str, base: type = object, **body) -> type:
    return type(name, (base,), {"__module__": module, **body})


class _Model(nn.Module):
    def __init__(self, *children: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList(children)


def _trainer(module: str, model: nn.Module | None = None, **attrs):
    trainer = _cls("CustomSeq2SeqTrainer", module)()
    trainer.model = model
    trainer.args = types.SimpleNamespace(use_liger_kernel=False)
    vars(trainer).update(attrs)
    return trainer


def test_plain_trainer_has_nothing_to_say():
    trainer = _trainer("transformers.trainer", _Model(nn.Linear(2, 2)))
    assert frameworks.framework_of(trainer) == (None, None)
    assert frameworks.describe(trainer) is None


def test_framework_named_by_its_trainer_class():
    assert frameworks.framework_of(_trainer("llamafactory.train.sft.trainer"))[0] == "LLaMA-Factory"
    assert frameworks.framework_of(_trainer("axolotl.core.trainers.base"))[0] == "axolotl"
    assert frameworks.framework_of(_trainer("trl.trainer.sft_trainer"))[0] == "TRL"
    # the most derived class decides: ms-swift's trainer built on TRL's is ms-swift
    trl_base = _cls("SFTTrainer", "trl.trainer.sft_trainer")
    swift = _cls("Seq2SeqTrainer", "swift.trainers.seq2seq_trainer", trl_base)()
    assert frameworks.framework_of(swift)[0] == "ms-swift"


def test_liger_module_on_the_model_is_a_conflict_named_with_its_switch():
    liger_norm = _cls("LigerRMSNorm", "liger_kernel.transformers.rms_norm", nn.Module,
                      forward=lambda self, x: x)
    trainer = _trainer("llamafactory.train.sft.trainer", _Model(liger_norm(), nn.Linear(2, 2)))
    found = frameworks.detect(trainer)
    assert found.name == "LLaMA-Factory"
    assert len(found.conflicts) == 1 and "Liger" in found.conflicts[0]
    assert "enable_liger_kernel: false" in found.conflicts[0]
    assert "LigerRMSNorm" in frameworks.describe(trainer)


def test_instance_forward_replaced_by_axolotl_lora_kernel():
    def apply_lora_mlp_swiglu(self, x):
        return x

    apply_lora_mlp_swiglu.__module__ = "axolotl.kernels.lora"
    mlp = nn.Linear(2, 2)
    mlp.forward = types.MethodType(apply_lora_mlp_swiglu, mlp)
    found = frameworks.detect(_trainer("axolotl.core.trainers.base", _Model(mlp)))
    assert found.conflicts and "axolotl kernels" in found.conflicts[0] and "lora_mlp_kernel" in found.conflicts[0]


def test_peft_wrapper_is_looked_through():
    liger_norm = _cls("LigerRMSNorm", "liger_kernel.transformers.rms_norm", nn.Module, forward=lambda self, x: x)
    inner = _Model(liger_norm())
    wrapper = nn.Module()
    wrapper.inner = inner
    wrapper.get_base_model = lambda: inner
    assert "Liger" in frameworks.foreign_kernels(wrapper)


def test_swift_compute_loss_is_no_note():
    from transformers import Trainer

    swift_cls = type("Seq2SeqTrainer", (Trainer,), {"__module__": "swift.trainers.seq2seq_trainer",
                                                    "compute_loss": lambda self, *a, **k: None})
    trainer = swift_cls.__new__(swift_cls)
    trainer.model = _Model(nn.Linear(2, 2))
    trainer.args = types.SimpleNamespace(use_liger_kernel=False)
    found = frameworks.detect(trainer)
    # whether the fused loss runs is read from the counters after train(), not guessed from an overridden
    # compute_loss (ms-swift's calls the model with labels: the fused loss runs there, tests/frameworks/test_swift)
    assert found.name == "ms-swift" and found.notes == []


def test_log_once_warns_on_conflict_and_says_it_once(caplog):
    import logging

    liger_norm = _cls("LigerRMSNorm", "liger_kernel.transformers.rms_norm", nn.Module, forward=lambda self, x: x)
    trainer = _trainer("llamafactory.train.sft.trainer", _Model(liger_norm()))
    logger = logging.getLogger("mindspeed_hf")
    with caplog.at_level(logging.INFO, logger="mindspeed_hf"):
        assert "Liger" in frameworks.log_once(trainer, logger)
        assert frameworks.log_once(trainer, logger) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "Liger" in r.getMessage()]
    assert len(warnings) == 1


def test_trl_fused_head_is_named_as_what_computes_the_loss():
    """TRL's chunked LM head (trl add_fused_lm_head, installed on the model instance after Trainer.__init__) is
    found by the code it runs, and named as what computes the loss instead of our fused loss."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    if not hasattr(trl_utils, "add_fused_lm_head"):
        pytest.skip("TRL's fused LM head was added in trl 1.15.0")
    from tiny_models import tiny_model

    model = tiny_model("qwen3")
    assert frameworks.head_notes(model) == []
    trl_utils.add_fused_lm_head(model)
    notes = frameworks.head_notes(model)
    assert len(notes) == 1 and "TRL computes the loss with its own chunked LM head" in notes[0]
    assert frameworks.detect(_trainer("trl.trainer.sft_trainer", model)).notes == notes


def test_transformers_hub_kernels_are_named_with_their_switch():
    """transformers' hub kernels (from_pretrained(use_kernels=...), on by default in 5.25 where the `kernels` package
    is installed) give a layer an instance forward from a hub repository (kernelize: `module.forward` and
    `module._kernel_repo`); the layers where that replaced ours are named, once per class, with the switches."""
    from tiny_models import tiny_model

    model = tiny_model("qwen3")
    for norm in (model.model.norm, model.model.layers[0].input_layernorm):  # what kernelize leaves on a layer
        norm.forward = types.MethodType(lambda self, x: x, norm)
        norm.__dict__["_kernel_repo"] = types.SimpleNamespace(repo_id="kernels-community/liger_kernels")
    found = frameworks.detect(_trainer("transformers.trainer", model))
    assert found.conflicts == [f"{frameworks.HUB_KERNELS} replaced mindspeed_hf's kernels on Qwen3RMSNorm.forward "
                               f"(kernels-community/liger_kernels) (turn off: {frameworks.HUB_SWITCH})"]


def test_accelerate_sequence_parallel_refused_on_our_attention():
    """accelerate's DeepSpeed Ulysses sequence parallelism wraps the attention named by sp_attn_implementation and
    DeepSpeed refuses a model configured with another (at accelerator.prepare): refused in one line when the trainer
    is built, naming both ways out; a model kept on sdpa goes on."""
    from tiny_models import tiny_model

    parallelism = types.SimpleNamespace(sp_size=2, sp_backend="deepspeed", sp_enabled=True)
    model = tiny_model("qwen3")
    model.config._attn_implementation = "mindspeed"
    trainer = _trainer("transformers.trainer", model)
    trainer.accelerator = types.SimpleNamespace(parallelism_config=parallelism)
    with pytest.raises(ValueError, match=r"parallelism_config.sp_size=2 .* runs mindspeed_hf's attention "
                                         r"\('mindspeed'\): build it with attn_implementation='sdpa'"):
        frameworks.check_sequence_parallel(trainer)
    model.config._attn_implementation = "sdpa"
    frameworks.check_sequence_parallel(trainer)
    parallelism.sp_enabled = False
    model.config._attn_implementation = "mindspeed"
    frameworks.check_sequence_parallel(trainer)
