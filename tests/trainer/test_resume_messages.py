"""What a resumed run says: the one "resuming from <path> (step N)" line, no missing-keys warning for a tied weight
(plain Trainer's warning for a truly missing key kept), and a bad path refused with Hugging Face's own "Can't find a
valid checkpoint at" text (what transformers' test_can_resume_training matches on)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from crash_driver import collate, dataset  # noqa: E402

from mindspeed_hf.trainers import checkpoints, wiring  # noqa: E402

HF_BAD_PATH = "Can't find a valid checkpoint at"


def _tied_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        max_position_embeddings=32, tie_word_embeddings=True))


def _trainer(out: Path, max_steps: int):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=2, save_steps=2,
                             report_to="none", disable_tqdm=True, use_cpu=True, dataloader_pin_memory=False)
    return Trainer(model=_tied_model(), args=args, train_dataset=dataset(), data_collator=collate)


@pytest.fixture
def wired():
    wiring.install_trainer_wiring()
    yield
    wiring.uninstall_trainer_wiring()


def _resume_records(out: Path, caplog) -> list[logging.LogRecord]:
    """Train 2 steps (checkpoint-2), then resume to 4 with the log captured."""
    _trainer(out, 2).train()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _trainer(out, 4).train(resume_from_checkpoint=True)
    return list(caplog.records)


def test_plain_hf_warns_tied_weights_missing_and_we_do_not(tmp_path, caplog):
    """The baseline first: plain Trainer warns `missing keys ['lm_head.weight']` for a tied model; wired, the tied
    key is not reported, and the run says where it continued."""
    plain = [r.getMessage() for r in _resume_records(tmp_path / "plain", caplog)]
    assert any(m.startswith(checkpoints.MISSING_KEYS) and "lm_head.weight" in m for m in plain), plain
    wiring.install_trainer_wiring()
    try:
        ours = [r.getMessage() for r in _resume_records(tmp_path / "ours", caplog)]
    finally:
        wiring.uninstall_trainer_wiring()
    assert not any(checkpoints.MISSING_KEYS in m for m in ours), ours
    assert f"mindspeed_hf: resuming from {tmp_path / 'ours' / 'checkpoint-2'} (step 2)" in ours, ours


def test_a_truly_missing_key_is_still_reported():
    """Only keys tied to a loaded tensor are left out: an untied missing key keeps Trainer's warning."""
    model = _tied_model()
    gate = checkpoints.TiedKeysFilter(model)
    tied = logging.LogRecord("transformers.trainer", logging.WARNING, __file__, 1,
                             f"{checkpoints.MISSING_KEYS}['lm_head.weight'].", (), None)
    assert not gate.filter(tied)
    both = logging.LogRecord("transformers.trainer", logging.WARNING, __file__, 1,
                             f"{checkpoints.MISSING_KEYS}['lm_head.weight', 'model.norm.weight'].", (), None)
    assert gate.filter(both) and both.getMessage() == f"{checkpoints.MISSING_KEYS}['model.norm.weight']."
    # both names of a tied pair missing: nothing was loaded into that tensor, so both are reported
    pair = logging.LogRecord("transformers.trainer", logging.WARNING, __file__, 1,
                             f"{checkpoints.MISSING_KEYS}['lm_head.weight', 'model.embed_tokens.weight'].", (), None)
    assert gate.filter(pair) and "model.embed_tokens.weight" in pair.getMessage()


def test_a_bad_resume_path_has_hf_text(tmp_path, wired):
    """transformers' test_can_resume_training: `train(resume_from_checkpoint=f"{checkpoint}-bogus")` must raise an
    error whose text holds "Can't find a valid checkpoint at" (as plain Trainer's does); ours keeps its reason."""
    trainer = _trainer(tmp_path, 4)
    trainer.train()
    bogus = f"{tmp_path / 'checkpoint-4'}-bogus"
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the text is what HF's test checks
        trainer.train(resume_from_checkpoint=bogus)
    assert HF_BAD_PATH in str(caught.value) and "not a directory" in str(caught.value), caught.value
    (tmp_path / "checkpoint-4" / checkpoints.COMPLETE_MARKER).unlink()  # an interrupted save
    with pytest.raises(checkpoints.CheckpointError, match=f"{HF_BAD_PATH} .*checkpoint-4'.*interrupted save"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
