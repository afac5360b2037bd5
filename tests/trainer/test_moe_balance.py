"""Auxiliary-loss-free expert balancing (moe/balance.py, `moe: {balance: aux_free, bias_update_rate}`):
with zero biases the routing is HF's own (loss and gradients against the unpatched model); a bias re-chooses the
experts by probability + bias with the weights from the probabilities (checked against a routing computed here from
the router's logits); each step moves the biases by the rate against the load; a Trainer run with it evens out a
router built to be imbalanced where the same run without it does not; routers with their own score-correction bias
(DeepSeek-V3) get that one updated; off by default and nothing attached; GPT-OSS's router refused in one line."""

from __future__ import annotations

import pytest
import torch
from tiny_models import assert_close_grads, imbalance_per_step, loss_and_grads, padded_batch, tiny_model
from transformers import Trainer, TrainingArguments

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.moe.balance import BIAS, AuxFreeBalance

pytestmark = pytest.mark.skipif(int(__import__("transformers").__version__.split(".")[0]) < 5,
                                reason="fused experts modules: transformers >= 5")
ON = config_from_dict({"moe": {"balance": "aux_free", "bias_update_rate": 0.05}})


def _routers(model) -> list[torch.nn.Module]:
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe", "qwen3_next"])
def test_zero_biases_route_as_hf(family):
    model = tiny_model(family)
    batch = padded_batch()
    want = loss_and_grads(model, batch)
    balance = AuxFreeBalance.attach(model, ON)
    assert len(balance.biases) == len(_routers(model)) and all(b.abs().sum() == 0 for b in balance.biases)
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, want[0], atol=1e-6, rtol=1e-6)
    assert_close_grads(want[1], grads, atol=1e-6, rtol=1e-6)


def test_a_bias_rechooses_the_experts_and_keeps_the_weights_from_the_probabilities():
    model = tiny_model("qwen3_moe")
    balance = AuxFreeBalance.attach(model, ON)
    router = _routers(model)[0]
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    getattr(router, BIAS).copy_(bias)
    hidden = torch.randn(10, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    logits, weights, chosen = router(hidden)
    probs = torch.softmax(logits.float(), -1)
    want = torch.topk(probs + bias, 2, dim=-1).indices
    assert torch.equal(chosen, want) and (chosen == 3).any(dim=-1).all()  # expert 3 in every token's pick
    picked = probs.gather(-1, want)
    if router.norm_topk_prob:
        picked = picked / picked.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, picked.to(weights.dtype))
    balance.remove()
    assert not torch.equal(router(hidden)[2], chosen)  # HF's own choice again


def test_each_step_moves_the_biases_against_the_load():
    model = tiny_model("qwen3_moe").train()
    balance = AuxFreeBalance.attach(model, ON)
    seen = []
    for router in _routers(model):
        router.register_forward_hook(lambda m, a, out: seen.append(out[2].detach().clone()))
    model(**padded_batch())
    balance.step()
    for ids, bias in zip(seen, balance.biases):
        load = torch.bincount(ids.reshape(-1), minlength=4).float()
        assert torch.equal(bias, 0.05 * torch.sign(load.mean() - load))
    balance.step()  # no forward since: nothing to move
    assert all(torch.equal(b, 0.05 * torch.sign(torch.bincount(i.reshape(-1), minlength=4).float().mean()
                                                 - torch.bincount(i.reshape(-1), minlength=4).float()))
               for i, b in zip(seen, balance.biases))


def test_a_native_score_correction_bias_is_the_one_updated():
    model = tiny_model("deepseek_v3").train()
    balance = AuxFreeBalance.attach(model, ON)
    native = [r.e_score_correction_bias for r in _routers(model)]
    assert len(native) == len(balance.biases) and all(a is b for a, b in zip(native, balance.biases))
    assert not any(hasattr(r, BIAS) for r in _routers(model))
    model(**padded_batch())
    balance.step()
    assert all(b.abs().sum() > 0 for b in native)


def test_gpt_oss_router_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"moe.balance=aux_free: .* valid choices: moe.balance=none") as error:
        AuxFreeBalance.attach(tiny_model("gpt_oss"), ON)
    assert "\n" not in str(error.value)


def test_the_biases_even_out_an_imbalanced_router():
    plain = imbalance_per_step({}, 20)
    balanced = imbalance_per_step({"moe": {"balance": "aux_free", "bias_update_rate": 0.02}}, 20)
    assert min(plain) > 1.95 and balanced[0] == plain[0]  # every token on expert 0; the biases start at zero
    assert balanced[-1] < 0.9 * plain[-1] and balanced[-1] < balanced[len(balanced) // 2], (plain, balanced)


def test_trainer_steps_the_biases_after_every_optimizer_step(tmp_path):
    mindspeed_hf.enable(config_from_dict({"moe": {"balance": "aux_free", "bias_update_rate": 0.01}}))
    model = tiny_model("qwen3_moe")
    rows = torch.randint(2, 120, (16, 12), generator=torch.Generator().manual_seed(0)).tolist()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, report_to="none", save_strategy="no", disable_tqdm=True,
                             use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows])
    seen: list[torch.Tensor] = []
    for router in _routers(model):  # after the balance's own hook: the experts each token really went to
        router.register_forward_hook(lambda m, a, out: seen.append(out[2].detach().clone()) if m.training else None)
    trainer.train()
    layers = len(_routers(model))
    want = [torch.zeros(4) for _ in range(layers)]
    for step in range(3):  # each optimizer step: the load of its two micro-batches, every layer
        forwards = seen[step * 2 * layers:(step + 1) * 2 * layers]
        for layer in range(layers):
            load = sum(torch.bincount(f.reshape(-1), minlength=4).float() for f in forwards[layer::layers])
            want[layer] += 0.01 * torch.sign(load.mean() - load)
    for router, bias in zip(_routers(model), want):
        torch.testing.assert_close(getattr(router, BIAS), bias)
    assert f"model.layers.0.mlp.gate.{BIAS}" in model.state_dict()  # saved with Trainer's checkpoints


def test_off_by_default_attaches_nothing():
    model = tiny_model("qwen3_moe")
    assert AuxFreeBalance.attach(model, config_from_dict({})) is None
    assert not any(hasattr(r, BIAS) or r._forward_hooks for r in _routers(model))


def test_a_dense_model_says_balancing_does_not_apply(caplog):
    with caplog.at_level("WARNING", logger="mindspeed_hf"):
        assert AuxFreeBalance.attach(tiny_model("qwen3"), ON) is None
    assert [r.getMessage() for r in caplog.records if "moe.balance=aux_free does not apply" in r.getMessage()]
