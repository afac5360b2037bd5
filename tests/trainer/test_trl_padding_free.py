"""TRL's padding-free SFT (`SFTConfig(padding_free=True)`: the batch's rows laid end to end in one row, told apart
by position ids restarting at 0, no attention mask) with `import mindspeed_hf`: the per-step losses and every metric
TRL logs equal plain TRL's padding-free run (HF's sdpa finds the rows from the position ids), and on the npu path
(the stand-in torch_npu) every attention call is one packed TND call with the rows' boundaries, as many as report()
counts. TRL warns that padding-free needs a flash attention; ours keeps the rows apart by their position ids on every
backend. (TRL's padding-free losses are not its padded ones: 2.7e-4 apart here, plain TRL alone; the reference is
plain TRL on the same padding-free batches.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.device import import_torch_npu
from mindspeed_hf.recipes.default_run import TOKENIZER_DIR, TRAIN_FILE

trl = pytest.importorskip("trl")
STEPS, ROWS = 3, 4


def _run(tmp_path, padding_free: bool, accelerated: bool, backend: str = "torch") -> tuple[list[dict], object]:
    import json

    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    if accelerated:
        mindspeed_hf.enable(config_from_dict({"backend": backend}))
    else:
        mindspeed_hf.disable()
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    with open(TRAIN_FILE) as f:
        rows = [json.loads(line) for _, line in zip(range(STEPS * ROWS), f)]
    logged: list[dict] = []

    class Logged(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logged.append({k: v for k, v in logs.items() if k not in ("learning_rate", "epoch", "grad_norm")})

    args = SFTConfig(output_dir=str(tmp_path / f"{padding_free}{accelerated}{backend}"), max_steps=STEPS,
                     per_device_train_batch_size=ROWS, learning_rate=1e-3, lr_scheduler_type="constant",
                     logging_steps=1, report_to=[], save_strategy="no", seed=0, use_cpu=True, max_length=None,
                     padding_free=padding_free, gradient_checkpointing=False, dataloader_num_workers=0,
                     bf16=False)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                         callbacks=[Logged()])
    trainer.train()
    return logged, trainer.model


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) == STEPS and a[0].keys() == b[0].keys()
    for x, y in zip(a, b):
        for key in x:
            assert abs(x[key] - y[key]) <= 1e-5 * max(1.0, abs(x[key])), (key, a, b)


def test_trl_padding_free_equals_plain_trl(tmp_path, monkeypatch):
    plain, _ = _run(tmp_path, padding_free=True, accelerated=False)
    fast, _ = _run(tmp_path, padding_free=True, accelerated=True)
    _same(plain, fast)

    npu = import_torch_npu()
    real, calls = npu.npu_fusion_attention, []

    def counting(*args, **kwargs):
        calls.append((args[4], len(kwargs.get("actual_seq_qlen") or ())))
        return real(*args, **kwargs)

    monkeypatch.setattr(npu, "npu_fusion_attention", counting)
    on_npu, model = _run(tmp_path, padding_free=True, accelerated=True, backend="npu")
    _same(plain, on_npu)
    assert {layout for layout, _ in calls} == {"TND"} and len(calls) == mindspeed_hf.report(model)["ran"]["attention"]
    assert all(documents == ROWS for _, documents in calls)  # each row its own sequence in the packed row
