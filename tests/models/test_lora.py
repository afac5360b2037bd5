"""A PEFT LoRA-wrapped model gets identical loss and LoRA gradients patched and unpatched: the fused MLP and
norm forwards must still route through the adapted submodules."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny_models import assert_close_grads, loss_and_grads, padded_batch, tiny_model

import mindspeed_hf
from mindspeed_hf.config import config_from_dict

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj"]


@pytest.mark.parametrize("model_type", ["qwen3", "phi3"])
def test_lora_parity(model_type, backend):
    model = tiny_model(model_type)
    targets = [t for t in TARGETS if any(n.endswith(t) for n, _ in model.named_modules())]
    torch.manual_seed(3)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                                                  init_lora_weights=False))
    batch = padded_batch()
    loss_ref, grads_ref = loss_and_grads(peft_model, batch)
    assert any("lora_A" in n for n in grads_ref) and not any("lora" not in n for n in grads_ref)

    mindspeed_hf.enable(config_from_dict({"backend": backend}))
    report = mindspeed_hf.apply_to_model(peft_model)
    assert report["kernels"]["swiglu"] == 2 and report["kernels"]["attention"] == 2
    loss, grads = loss_and_grads(peft_model, batch)
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
    assert_close_grads(grads_ref, grads)



@pytest.mark.parametrize("peft", [False, True])
def test_a_forward_called_past_its_hooks_runs_under_the_models_config_and_is_counted(peft):
    """PEFT's tuner (0.17 .. 0.18) calls the causal LM's `forward` directly, past its hooks (here also called so
    directly): the config the model was given still decides the loss head (the fused loss off while the process
    config has it on, and on), and what ran is counted."""
    import torch
    from peft import LoraConfig, get_peft_model
    from tiny_models import padded_batch, tiny_model

    import mindspeed_hf
    from mindspeed_hf.config import config_from_dict
    from mindspeed_hf.patches import scope

    mindspeed_hf.enable()
    batch = padded_batch()
    for fused in (True, False):
        model = tiny_model("llama")
        if peft:
            model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
        mindspeed_hf.apply_to_model(model, config_from_dict({"kernels": {"fused_linear_cross_entropy": fused}}))
        model.train()
        causal_lm = model.get_base_model() if peft else model
        with scope.logits_unread_window():
            out = causal_lm.forward(**batch)
        assert mindspeed_hf.report(model)["ran"]["fused_linear_cross_entropy"] == int(fused)
        assert torch.isfinite(out.loss)
        if not fused:  # HF's head and loss ran: real logits
            assert torch.is_tensor(out.logits) and out.logits.shape[-1] == causal_lm.config.vocab_size
