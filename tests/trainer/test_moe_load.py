"""MoE training people can watch (moe/load.py): a plain Trainer on a MoE model logs `moe/*` keys with every
training loss, equal to a count made independently from the router outputs of the same steps (forward hooks on each
layer's router in the test); eval forwards and recompute in backward are not counted; `moe.log_load: false` adds
nothing and no hook."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import tiny_model
from transformers import Trainer, TrainingArguments

import mindspeed_hf
from mindspeed_hf.bench.plot import matplotlib_available
from mindspeed_hf.config import config_from_dict

FIVE = int(__import__("transformers").__version__.split(".")[0]) >= 5


def _rows(n: int = 16) -> list[dict[str, list[int]]]:
    rows = torch.randint(2, 120, (n, 12), generator=torch.Generator().manual_seed(0)).tolist()
    return [{"input_ids": r, "labels": r} for r in rows]


def _routers(model) -> list[torch.nn.Module]:
    """Each MoE layer's router, by what it returns (router logits, weights, top-k ids), found independently of ours."""
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def _expected(steps: list[list[torch.Tensor]], experts: int) -> list[dict[str, float]]:
    out = []
    for per_layer in steps:
        counts = torch.stack([torch.bincount(ids.reshape(-1), minlength=experts).float() for ids in per_layer])
        imbalance = (counts.max(1).values / counts.mean(1)).tolist()
        out.append({"imbalance": [round(x, 4) for x in imbalance], "zero": (counts == 0).sum(1).tolist(),
                    "routed": counts.sum().item() / len(per_layer)})
    return out


@pytest.mark.skipif(not FIVE, reason="fused experts modules: transformers >= 5")
@pytest.mark.parametrize("recompute", [False, True])
def test_the_logged_load_equals_a_count_from_the_router(tmp_path, recompute):
    mindspeed_hf.enable()
    model = tiny_model("qwen3_moe")
    seen: list[torch.Tensor] = []
    for router in _routers(model):  # the router's own output: (logits, top-k weights, top-k ids)
        router.register_forward_hook(lambda m, a, out: seen.append(out[2].detach().clone()) if m.training else None)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, logging_steps=1,
                             report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True,
                             gradient_checkpointing=recompute, eval_strategy="steps", eval_steps=2)
    trainer = Trainer(model=model, args=args, train_dataset=_rows(), eval_dataset=_rows(4))
    trainer.train()
    layers = len(_routers(model))
    forwards = [seen[i:i + layers] for i in range(0, len(seen), layers)]
    # recompute reruns each layer's router in backward: the router sees those too, the load counts one forward
    per_step = forwards[::2] if recompute else forwards
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3 and len(per_step) == 3
    for log, want in zip(logged, _expected(per_step, model.config.num_experts)):
        got = [log[f"moe/layer_{i}/imbalance"] for i in range(layers)]
        assert got == pytest.approx(want["imbalance"], abs=1e-4)
        assert [log[f"moe/layer_{i}/zero_token_experts"] for i in range(layers)] == want["zero"]
        assert log["moe/imbalance_max"] == pytest.approx(max(want["imbalance"]), abs=1e-4)
        assert log["moe/zero_token_experts"] == sum(want["zero"])
        assert log["moe/routed_per_layer"] == want["routed"] == 4 * 12 * model.config.num_experts_per_tok
    assert not any(k.startswith("moe/") for h in trainer.state.log_history if "eval_loss" in h for k in h)


def test_off_adds_nothing(tmp_path):
    mindspeed_hf.enable(config_from_dict({"moe": {"log_load": False}}))
    model = tiny_model("qwen3_moe")
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, logging_steps=1,
                             report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=_rows())
    hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
    trainer.train()
    assert not any(k.startswith("moe/") for h in trainer.state.log_history for k in h)
    mindspeed_hf.enable()
    on = Trainer(model=tiny_model("qwen3_moe"), args=args, train_dataset=_rows())
    assert sum(len(m._forward_pre_hooks) for m in on.model.modules()) > hooks or not FIVE


MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss", "ernie4_5_moe",
                "qwen3_next", "qwen3_5_moe_text")


@pytest.mark.skipif(not FIVE, reason="fused experts modules: transformers >= 5")
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) for f in MOE_FAMILIES])
def test_every_moe_family_logs_its_load(tmp_path, family):
    mindspeed_hf.enable()
    model = tiny_model(family)
    config = model.config
    top_k = getattr(config, "num_experts_per_tok", None) or config.moe_k
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, logging_steps=1,
                             report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=_rows())
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert log["moe/routed_per_layer"] == 4 * 12 * top_k  # every token's top-k assignments, counted once
    assert 1.0 <= log["moe/imbalance"] <= log["moe/imbalance_max"]


@pytest.mark.skipif(not FIVE, reason="fused experts modules: transformers >= 5")
def test_a_log_written_outside_the_training_loop_is_left_alone(tmp_path):
    """take() is collective: only Trainer's own training log (loss and learning rate, written on every rank) reads
    the counters; a script's or callback's log(...) on one rank gets no moe/* keys and keeps the interval's counts."""
    mindspeed_hf.enable()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, logging_steps=1,
                             report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True)
    trainer = Trainer(model=tiny_model("qwen3_moe"), args=args, train_dataset=_rows())
    trainer.model.train()
    trainer.model(input_ids=torch.tensor([r["input_ids"] for r in _rows(2)]))
    trainer.log({"loss": 1.0})
    assert not any(k.startswith("moe/") for k in trainer.state.log_history[-1])
    trainer.log({"loss": 1.0, "learning_rate": 0.1})
    assert trainer.state.log_history[-1]["moe/routed_per_layer"] == 2 * 12 * 2  # the counts were kept until then


@pytest.mark.skipif(not FIVE, reason="fused experts modules: transformers >= 5")
def test_the_history_file_and_the_moe_command(tmp_path, capsys):
    """Each logged interval's tokens per expert go to OUTPUT_DIR/moe_load.jsonl (the same counts the moe/* keys come
    from); `mindspeed-hf moe OUTPUT_DIR` tabulates them and --plot draws the heatmap; a directory without the file is
    a one-line error."""
    from mindspeed_hf.cli.main import main

    mindspeed_hf.enable()
    model = tiny_model("qwen3_moe")
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, logging_steps=1,
                             report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=_rows())
    trainer.train()
    lines = [json.loads(line) for line in (tmp_path / "moe_load.jsonl").read_text().splitlines()]
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [line["step"] for line in lines] == [h["step"] for h in logged] == [1, 2, 3]
    for line, log in zip(lines, logged):
        tokens = torch.tensor(line["tokens"], dtype=torch.float)
        assert tokens.shape == (len(_routers(model)), model.config.num_experts)
        assert tokens.sum(1).tolist() == [4 * 12 * model.config.num_experts_per_tok] * len(_routers(model))
        assert (tokens.max(1).values / tokens.mean(1)).tolist() == pytest.approx(
            [log[f"moe/layer_{i}/imbalance"] for i in range(tokens.shape[0])], abs=1e-4)
    capsys.readouterr()
    chart = tmp_path / "heat.png"
    plot = ["--plot", str(chart)] if matplotlib_available() else []
    assert main(["moe", str(tmp_path), *plot]) == 0
    out = capsys.readouterr().out
    assert "expert load over 3 logged interval(s), steps 1..3" in out and "| 1 |" in out
    assert not plot or chart.stat().st_size > 0
    assert main(["moe", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip()
    assert "moe_load.jsonl" in err and "\n" not in err
