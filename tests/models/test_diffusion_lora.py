"""LoRA as diffusers' training scripts add it (`add_adapter(LoraConfig(...))` on the denoiser, base frozen): with the
kernels on (npu path), every LoRA layer still runs in each forward, and the loss and the adapters' gradients equal
plain diffusers with the same adapters (Flux's joint attention, Wan's self / cross attention)."""

import pytest
import torch
from tiny_denoisers import FAMILIES, assert_close_grads, loss_and_grads, noisy_batch

import mindspeed_hf
from mindspeed_hf.config import config_from_dict

peft = pytest.importorskip("peft")

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_lora_adapters_run_and_match(name):
    tiny = FAMILIES[name]()
    tiny.model.requires_grad_(False)
    tiny.model.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=TARGETS))
    torch.manual_seed(1)
    with torch.no_grad():  # B starts at zero: make the adapters matter (and A's gradient non-zero)
        for param_name, param in tiny.model.named_parameters():
            if "lora_B" in param_name:
                param.normal_(std=0.1)
    batch = noisy_batch(tiny)
    expected = loss_and_grads(tiny, batch)
    assert expected[1] and all("lora_" in n for n in expected[1])

    mindspeed_hf.enable(config_from_dict({"backend": "npu"}))
    report = mindspeed_hf.apply_to_model(tiny.model)
    assert report["kernels"]["attention"] > 0
    lora_a = [m for n, m in tiny.model.named_modules() if n.endswith("lora_A.default")]
    calls = []
    handles = [m.register_forward_hook(lambda *_: calls.append(1)) for m in lora_a]
    loss, grads = loss_and_grads(tiny, batch)
    for handle in handles:
        handle.remove()
    assert len(calls) == len(lora_a)  # every adapter ran once
    assert mindspeed_hf.report(tiny.model)["ran"]["attention"] == tiny.expect["attention"]
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)
