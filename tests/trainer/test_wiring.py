"""The drop-in wiring of transformers.Trainer and MindSpeedTrainer itself (in this process; tests/conftest.py
imports the package with MINDSPEED_HF_AUTO=0 and disables it after every test)."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
import transformers
from conftest import run
from transformers import Qwen3Config, Qwen3ForCausalLM, Trainer, TrainingArguments

import mindspeed_hf
from mindspeed_hf.runtime import run_of
from mindspeed_hf.trainers import MindSpeedTrainer, MindSpeedTrainingArguments, wiring

WRAPPED = ("__init__", "call_model_init", "train")
ORIGINALS = {name: vars(Trainer)[name] for name in WRAPPED}  # taken before anything here enables the package

#: the ops a llama model has no site for (MoE experts, Gated DeltaNet layers)
LLAMA_HAS_NO = ("experts", "linear_attention")


def tiny_model(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        max_position_embeddings=32))


def dataset(n: int = 16, length: int = 12) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(1, 64, (n, length), generator=gen).tolist()
    return [{"input_ids": r, "labels": r} for r in rows]


def quick_args(tmp_path, cls=TrainingArguments, **kw):
    values = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to="none",
                  save_strategy="no", disable_tqdm=True, use_cpu=True)
    return cls(**{**values, **kw})


def test_install_uninstall_restore_trainer_exactly(restore_wiring):
    wiring.uninstall_trainer_wiring()
    assert all(vars(Trainer)[n] is ORIGINALS[n] for n in WRAPPED)
    wiring.install_trainer_wiring()
    wrapped = {n: vars(Trainer)[n] for n in WRAPPED}
    for name in WRAPPED:
        assert wrapped[name] is not ORIGINALS[name] and wrapped[name].__wrapped__ is ORIGINALS[name]
    wiring.install_trainer_wiring()  # idempotent: no second layer
    assert all(vars(Trainer)[n] is wrapped[n] for n in WRAPPED)
    wiring.uninstall_trainer_wiring()
    wiring.uninstall_trainer_wiring()
    assert all(vars(Trainer)[n] is ORIGINALS[n] for n in WRAPPED)
    assert not wiring.is_installed()


def test_enable_and_disable_drive_the_wiring(restore_wiring):
    mindspeed_hf.enable()
    assert wiring.is_installed() and vars(Trainer)["__init__"] is not ORIGINALS["__init__"]
    mindspeed_hf.disable()
    assert not wiring.is_installed() and all(vars(Trainer)[n] is ORIGINALS[n] for n in WRAPPED)


def test_plain_trainer_gets_the_kernels(tmp_path, restore_wiring):
    model = tiny_model()  # built before the package is enabled: HF's default attention (sdpa)
    assert model.config._attn_implementation == "sdpa"
    mindspeed_hf.enable()
    trainer = Trainer(model, quick_args(tmp_path), train_dataset=dataset())  # positional model and args
    assert model.config._attn_implementation == "mindspeed"
    assert all(n for op, n in run_of(trainer).report["kernels"].items() if op not in LLAMA_HAS_NO)
    trainer.train()


def test_trainer_imported_before_mindspeed_hf_is_wired(tmp_path):
    script = (
        "from transformers import Trainer, TrainingArguments\n"
        "import mindspeed_hf, torch, json\n"
        "from transformers import Qwen3Config, Qwen3ForCausalLM\n"
        "torch.manual_seed(0)\n"
        "m = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,"
        " num_attention_heads=4, num_key_value_heads=2, head_dim=8))\n"
        f"t = Trainer(model=m, args=TrainingArguments(output_dir={str(tmp_path)!r}, report_to='none'))\n"
        "print(json.dumps(mindspeed_hf.trainers.run_of(t).report))\n"
    )
    proc = run([sys.executable, "-c", script], auto=True)
    assert '"attention": 2' in proc.stdout and '"rms_norm": 9' in proc.stdout


def test_mindspeed_trainer_prepares_once_under_the_wiring(tmp_path, restore_wiring, monkeypatch):
    mindspeed_hf.enable()
    calls = []
    from mindspeed_hf.patches import apply

    original = apply.apply_to_model
    monkeypatch.setattr(apply, "apply_to_model", lambda m, c=None: calls.append(m) or original(m, c))
    trainer = MindSpeedTrainer(model=tiny_model(), args=quick_args(tmp_path), train_dataset=dataset())
    assert len(calls) == 1 and trainer.mindspeed_report["kernels"]["swiglu"] == 2


def test_arguments_config_belongs_to_the_trainer(tmp_path, restore_wiring):
    mindspeed_hf.enable()
    args = quick_args(tmp_path, MindSpeedTrainingArguments, mindspeed_rope=False)
    trainer = MindSpeedTrainer(model=tiny_model(), args=args, train_dataset=dataset())
    assert trainer.mindspeed_report["kernels"]["rope"] == 0 and trainer.mindspeed_report["kernels"]["rms_norm"] > 0
    assert mindspeed_hf.get_config().kernels.rope is True  # the process config is untouched
    assert mindspeed_hf.report(tiny_model())["kernels"]["rope"] == 2  # and so are other models


def test_recompute_is_on_and_logged(tmp_path, caplog):
    args = quick_args(tmp_path, MindSpeedTrainingArguments, mindspeed_recompute=True)
    model = tiny_model()
    with caplog.at_level(logging.INFO, logger="mindspeed_hf"):
        trainer = MindSpeedTrainer(model=model, args=args, train_dataset=dataset())
    assert model.is_gradient_checkpointing
    assert "recompute is on" in caplog.text
    trainer.train()


def test_peft_model_is_accelerated_and_adapters_train(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    args = quick_args(tmp_path, MindSpeedTrainingArguments, learning_rate=1e-2, mindspeed_recompute=True)
    trainer = MindSpeedTrainer(model=model, args=args, train_dataset=dataset())
    assert all(n for op, n in trainer.mindspeed_report["kernels"].items() if op not in LLAMA_HAS_NO)
    assert model.get_base_model().is_gradient_checkpointing  # recompute reaches the model under the LoRA wrapper
    trainer.train()
    after = dict(model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before), "LoRA adapters did not train"


def test_model_init_models_are_prepared(tmp_path, restore_wiring):
    mindspeed_hf.enable()
    trainer = Trainer(model_init=lambda: tiny_model(), args=quick_args(tmp_path), train_dataset=dataset())
    assert trainer.model.config._attn_implementation == "mindspeed"
    assert all(n for op, n in run_of(trainer).report["kernels"].items() if op not in LLAMA_HAS_NO)
    trainer.train()  # train() builds a fresh model through model_init: prepared again
    assert trainer.model.config._attn_implementation == "mindspeed"


def test_liger_is_kept_off_an_accelerated_model(tmp_path, caplog, restore_wiring):
    mindspeed_hf.enable()
    if not hasattr(transformers.trainer, "apply_liger_kernel"):  # transformers < 5: Liger runs in __init__
        with pytest.raises(ValueError, match="use_liger_kernel=True: transformers .* applies Liger inside"):
            Trainer(model=tiny_model(), args=quick_args(tmp_path, use_liger_kernel=True), train_dataset=dataset())
        return
    original = transformers.trainer.apply_liger_kernel
    args = quick_args(tmp_path, use_liger_kernel=True, prediction_loss_only=True, eval_strategy="steps",
                      eval_steps=1)
    with caplog.at_level(logging.WARNING, logger="mindspeed_hf"):
        trainer = Trainer(model=tiny_model(), args=args, train_dataset=dataset(), eval_dataset=dataset(8))
        trainer.train()  # would raise ImportError (no liger-kernel here) or double-patch if Liger ran
        metrics = trainer.evaluate()  # Trainer passes skip_logits=True: the accelerated forward takes it
    assert caplog.text.count("Liger's patching is skipped") == 1
    assert transformers.trainer.apply_liger_kernel is original
    assert metrics["eval_loss"] > 0


def test_unaccelerated_liger_path_is_untouched(tmp_path):
    """With the package off, use_liger_kernel goes to Liger as before (ImportError here, without it)."""
    from mindspeed_hf.ops.registry import liger_available

    if liger_available():
        pytest.skip("liger-kernel is installed")
    with pytest.raises(ImportError, match="liger"):  # at train() (transformers 5) or in __init__ (4.57)
        Trainer(model=tiny_model(), args=quick_args(tmp_path, use_liger_kernel=True), train_dataset=dataset()).train()


def test_plain_trainer_reads_mindspeed_hf_config(tmp_path, monkeypatch, restore_wiring):
    config = tmp_path / "accelerator.yaml"
    config.write_text("kernels:\n  swiglu: false\nmemory:\n  recompute: true\n")
    monkeypatch.setenv("MINDSPEED_HF_CONFIG", str(config))
    mindspeed_hf.enable()  # what `import mindspeed_hf` does
    model = tiny_model()
    trainer = Trainer(model=model, args=quick_args(tmp_path), train_dataset=dataset())
    assert model.is_gradient_checkpointing
    assert run_of(trainer).report["kernels"]["swiglu"] == 0 and run_of(trainer).report["kernels"]["rope"] > 0
    trainer.train()


# ------------------------------------------------------------------------------------------ what ran
def _rms_norms(model) -> int:
    """RMSNorm modules, counted from the model itself (not from our report)."""
    return sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())


def test_report_counts_what_ran_not_what_was_patched(restore_wiring):
    mindspeed_hf.enable()
    model = tiny_model()
    assert mindspeed_hf.report(model)["ran"]["rms_norm"] == 0  # built, patched, not run yet
    ids = torch.randint(1, 64, (2, 8))
    model(input_ids=ids)
    model(input_ids=ids)
    ran = mindspeed_hf.report(model)["ran"]
    assert ran["rms_norm"] == 2 * _rms_norms(model) and ran["attention"] == 2 * model.config.num_hidden_layers
    assert ran["fused_linear_cross_entropy"] == 0  # no labels: HF's head ran
    with mindspeed_hf.patches.scope.logits_unread_window():
        model(input_ids=ids, labels=ids)
    assert mindspeed_hf.report(model)["ran"]["fused_linear_cross_entropy"] == 1
    other = tiny_model()  # counted per model
    assert mindspeed_hf.report(other)["ran"]["rms_norm"] == 0


def test_trainer_counts_the_fused_loss_as_run(tmp_path, restore_wiring, caplog):
    mindspeed_hf.enable()
    trainer = Trainer(model=tiny_model(), args=quick_args(tmp_path), train_dataset=dataset())
    with caplog.at_level(logging.WARNING, logger="mindspeed_hf"):
        trainer.train()
    ran = mindspeed_hf.report(trainer.model)["ran"]
    assert ran["fused_linear_cross_entropy"] == 2 and ran["swiglu"] >= 2 * 2
    assert "never ran" not in caplog.text


class OwnLossTrainer(Trainer):
    """A trainer that computes its loss from the logits itself (as ms-swift's Seq2SeqTrainer does)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return (loss, logits) if return_outputs else loss


def test_a_patched_kernel_that_never_ran_is_named_with_its_cause(tmp_path, restore_wiring, caplog):
    mindspeed_hf.enable()
    trainer = OwnLossTrainer(model=tiny_model(), args=quick_args(tmp_path), train_dataset=dataset())
    with caplog.at_level(logging.WARNING, logger="mindspeed_hf"):
        trainer.train()
    lines = [r.getMessage() for r in caplog.records if "never ran" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith("mindspeed_hf: fused_linear_cross_entropy patched into Qwen3ForCausalLM but never ran")
    assert f"{__name__}.OwnLossTrainer.compute_loss computes the loss itself" in lines[0]


def test_a_kernel_replaced_by_other_code_is_named(tmp_path, restore_wiring, caplog, monkeypatch):
    """Another library patching the same class after us (as LLaMA-Factory's enable_liger_kernel does) is found."""
    from transformers.models.qwen3 import modeling_qwen3

    mindspeed_hf.enable()
    original = mindspeed_hf.patches.apply._patches.original(modeling_qwen3.Qwen3RMSNorm, "forward")

    def forward(self, hidden_states):  # somebody else's kernel
        return original(self, hidden_states)

    forward.__module__ = "other_kernels.rms_norm"
    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", forward)
    trainer = Trainer(model=tiny_model(), args=quick_args(tmp_path), train_dataset=dataset())
    with caplog.at_level(logging.WARNING, logger="mindspeed_hf"):
        trainer.train()
    lines = [r.getMessage() for r in caplog.records if "never ran" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("mindspeed_hf: rms_norm patched into Qwen3ForCausalLM")
    assert "Qwen3RMSNorm.forward (by other_kernels.rms_norm)" in lines[0]


LAZY_TRAINER = """
import sys
import accelerate, torch, transformers
import mindspeed_hf
from mindspeed_hf.releases import seams
heavy = [m for m in ('transformers.trainer', 'transformers.training_args', 'peft', 'datasets', 'bitsandbytes',
                     'mindspeed_hf.trainers.wiring') if m in sys.modules]
assert mindspeed_hf.is_enabled() and not heavy, heavy
if sys.argv[1] == 'seam_gone':
    real = seams.problems
    seams.problems = lambda trainer=True: 'mindspeed_hf: transformers X no longer has Y' if trainer else real(False)
if sys.argv[1] == 'arguments_first':  # built before the Trainer is imported: its DeepSpeed steps are wired
    from transformers import TrainingArguments
    assert getattr(TrainingArguments.__post_init__, '_mindspeed_wiring', False)
    assert 'transformers.trainer' not in sys.modules
from transformers import Trainer
from mindspeed_hf.trainers import is_installed
wired = getattr(Trainer.train, '_mindspeed_wiring', False)
if sys.argv[1] == 'seam_gone':
    assert not mindspeed_hf.is_enabled() and not wired and not is_installed()
else:
    assert wired and is_installed()
    mindspeed_hf.disable()
    assert not is_installed() and not getattr(Trainer.train, '_mindspeed_wiring', False)
    from transformers import TrainingArguments
    assert not getattr(TrainingArguments.__post_init__, '_mindspeed_wiring', False)
print('ok')
"""


@pytest.mark.parametrize("case", ["wired", "arguments_first", "seam_gone"])
def test_trainer_is_wired_when_it_is_imported(case):
    """`import mindspeed_hf` in a script without a Trainer imports neither transformers' Trainer nor what it pulls
    in (PEFT, bitsandbytes, datasets: seconds of start-up); the Trainer is wired right after its import, its seams
    checked then (TrainingArguments' DeepSpeed steps are wired at their own import, which may come first): a release
    lacking one turns the accelerator off with one warning, the import itself succeeds."""
    import os
    import subprocess

    env = {**os.environ, "MINDSPEED_HF_AUTO": "1", "MINDSPEED_HF_BACKEND": "torch"}
    done = subprocess.run([sys.executable, "-c", LAZY_TRAINER, case], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
    assert ("The accelerator stays off" in done.stderr) == (case == "seam_gone")
