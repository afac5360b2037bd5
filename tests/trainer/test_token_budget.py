"""Token-budget batches (`data.max_tokens_per_batch`; data/token_budget.py, trainers/batching.py): batches never exceed
the budget, every row once per epoch, deterministic per seed, a batch count dealt evenly to the dp ranks; through a
plain Trainer each step's loss equals a plain HF Trainer's on the same batches (the loss normalised by the release's
own token count), and a run resumed mid-epoch trains the same batches to the same losses as the uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.data.token_budget import TokenBudgetBatchSampler, batch_cost

BUDGET = 96


def _lengths(n: int = 40, seed: int = 0) -> list[int]:
    return torch.randint(3, 30, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("shards", [1, 2, 3])
def test_batches_fit_the_budget_hold_every_row_once_and_deal_evenly(packed, shards):
    lengths = _lengths()
    sampler = TokenBudgetBatchSampler(lengths, BUDGET, packed=packed, seed=3, num_shards=shards)
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert all(batch_cost([lengths[i] for i in b], packed) <= BUDGET for b in batches)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        assert len(batches) == len(sampler) and len(batches) % shards == 0
        epochs.append(batches)
    assert epochs[0] != epochs[1] and sorted(epochs[0]) == sorted(epochs[1])  # same batches, another order
    again = TokenBudgetBatchSampler(lengths, BUDGET, packed=packed, seed=3, num_shards=shards)
    assert list(again) == epochs[0]  # a function of (lengths, budget, seed, epoch)
    if not packed:  # grouped by length: little padding (rows x longest stays close to the tokens)
        padded = sum(batch_cost([lengths[i] for i in b], False) for b in epochs[0])
        assert padded <= 1.25 * sum(lengths)


def test_bad_budgets_are_one_line_errors_naming_the_setting():
    with pytest.raises(ValueError, match=r"data.max_tokens_per_batch=10: row 2 has 12 tokens"):
        TokenBudgetBatchSampler([3, 4, 12, 5], 10)
    with pytest.raises(ValueError, match="data.max_tokens_per_batch: 1 rows make 1 batches"):
        TokenBudgetBatchSampler([3], 10, num_shards=2)
    with pytest.raises(ValueError, match="data.max_tokens_per_batch"):
        config_from_dict({"data": {"max_tokens_per_batch": -1}})


def _rows(n: int = 16) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for length in _lengths(n, seed=2):
        ids = torch.randint(2, 120, (length,), generator=gen).tolist()
        out.append({"input_ids": ids, "labels": ids})
    return out


def _pad(features):
    """Right padding (pad id 0, labels -100, an attention mask): what a padding collator hands the model."""
    width = max(len(f["input_ids"]) for f in features)
    batch = {"input_ids": [], "labels": [], "attention_mask": []}
    for f in features:
        gap = width - len(f["input_ids"])
        batch["input_ids"].append(list(f["input_ids"]) + [0] * gap)
        batch["labels"].append(list(f["labels"]) + [-100] * gap)
        batch["attention_mask"].append([1] * len(f["input_ids"]) + [0] * gap)
    return {k: torch.tensor(v) for k, v in batch.items()}


class _Recording:
    """The collator Trainer is given, recording every batch it makes (the tensors the model gets)."""

    def __init__(self, inner) -> None:
        self.inner, self.batches = inner, []

    def __call__(self, features):
        batch = self.inner(features)
        self.batches.append({k: v.clone() for k, v in batch.items()})
        return batch


class _RecordingFlattening(DataCollatorWithFlattening):
    """HF's flattening collator (so the budget counts the sum of the lengths), recording its batches."""

    def __init__(self) -> None:
        super().__init__()
        self.batches = []

    def __call__(self, features, *args, **kwargs):
        batch = super().__call__(features, *args, **kwargs)
        self.batches.append({k: v.clone() for k, v in batch.items()})
        return batch


def _documents(batch) -> list[list[int]]:
    """The rows of a batch: a packed row split where its positions restart, else each row without its padding."""
    if "position_ids" in batch and batch["input_ids"].shape[0] == 1:
        ids = batch["input_ids"][0]
        starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [ids.shape[0]]
        return [ids[s:e].tolist() for s, e in zip(starts, starts[1:])]
    return [r[m.bool()].tolist() for r, m in zip(batch["input_ids"], batch["attention_mask"])]


def _train(tmp_path, collator, steps: int | None = None, resume: str | None = None, epochs: int = 2,
           save_steps: int = 0):
    mindspeed_hf.enable(config_from_dict({"data": {"max_tokens_per_batch": BUDGET}}))
    losses: list[float] = []

    class Logged(Trainer):
        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            losses.append(loss.item())
            return loss

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, num_train_epochs=epochs,
                             max_steps=steps or -1, learning_rate=1e-3, lr_scheduler_type="constant", max_grad_norm=0,
                             report_to="none", use_cpu=True, seed=0, disable_tqdm=True, logging_steps=1,
                             dataloader_pin_memory=False, save_strategy="steps" if save_steps else "no",
                             save_steps=save_steps or 500)
    trainer = Logged(model=tiny_model("qwen3"), args=args, train_dataset=_rows(), data_collator=collator)
    trainer.train(resume_from_checkpoint=resume)
    return losses, collator.batches


def _tokens(batch) -> int:
    return batch["input_ids"].numel()


def _hf_losses(tmp_path, batches) -> list[float]:
    """Plain HF (mindspeed_hf disabled): a plain Trainer fed exactly the batches our run trained on, in the same
    order, so the loss normalisation is that release's own."""
    from torch.utils.data import DataLoader

    mindspeed_hf.disable()
    losses: list[float] = []

    class Fixed(Trainer):
        def get_train_dataloader(self):
            return self.accelerator.prepare(DataLoader(batches, batch_size=1, collate_fn=lambda b: b[0]))

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            losses.append(loss.item())
            return loss

    args = TrainingArguments(output_dir=str(tmp_path / "hf"), num_train_epochs=1, learning_rate=1e-3, max_grad_norm=0,
                             lr_scheduler_type="constant", report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
                             save_strategy="no", dataloader_pin_memory=False)
    Fixed(model=tiny_model("qwen3"), args=args, train_dataset=batches).train()
    return losses


@pytest.mark.parametrize("packed", [False, True])
def test_trainer_steps_fit_the_budget_and_equal_plain_hf(tmp_path, packed):
    losses, batches = _train(tmp_path, _RecordingFlattening() if packed else _Recording(_pad))
    assert all(_tokens(b) <= BUDGET for b in batches)
    if packed:  # the sum of the lengths counts: more rows per batch than padded batches hold
        assert len(batches) < 2 * len(TokenBudgetBatchSampler(_lengths(16, seed=2), BUDGET))
    rows = sorted(r["input_ids"] for r in _rows())
    per_epoch = len(batches) // 2
    for epoch in range(2):
        seen = [d for b in batches[epoch * per_epoch:(epoch + 1) * per_epoch] for d in _documents(b)]
        assert sorted(seen) == rows  # every row once per epoch
    reference = _hf_losses(tmp_path, batches)
    assert max(abs(a - b) for a, b in zip(losses, reference)) <= 1e-5, (losses, reference)


def test_resume_mid_epoch_trains_the_same_batches(tmp_path):
    full, full_batches = _train(tmp_path / "full", _Recording(_pad), epochs=1, save_steps=3)
    _train(tmp_path / "cut", _Recording(_pad), steps=3, epochs=1, save_steps=3)
    resumed, resumed_batches = _train(tmp_path / "cut", _Recording(_pad), epochs=1,
                                      resume=str(tmp_path / "cut" / "checkpoint-3"))
    assert len(resumed) == len(full) - 3
    for a, b in zip(resumed_batches, full_batches[3:]):
        assert torch.equal(a["input_ids"], b["input_ids"])
    assert max(abs(a - b) for a, b in zip(resumed, full[3:])) <= 1e-6


def test_every_source_names_it_as_the_issue_does():
    """The run YAML's data section, MINDSPEED_HF_DATA_MAX_TOKENS_PER_BATCH and --mindspeed_max_tokens_per_batch."""
    from mindspeed_hf.config.schema import SETTINGS
    from mindspeed_hf.recipes.default_run import DEFAULT_RUN_DIR
    from mindspeed_hf.recipes.run_config import parse_run_config

    run = parse_run_config({"model": {"config": {"model_type": "qwen3"}, "tokenizer": "tokenizer"},
                            "data": {"train": "train.jsonl", "max_tokens_per_batch": 128}}, DEFAULT_RUN_DIR)
    assert run.mindspeed.data.max_tokens_per_batch == 128
    setting = SETTINGS["data.max_tokens_per_batch"]
    assert setting.env == "MINDSPEED_HF_DATA_MAX_TOKENS_PER_BATCH"
    assert setting.argument == "mindspeed_max_tokens_per_batch"
