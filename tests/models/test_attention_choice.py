"""Explicit attention requests win: only the default attention becomes the fused kernel. A model built with
`attn_implementation="sdpa"` (or switched with `set_attn_implementation`) keeps what was asked for, also when a
trainer applies its config, and report() says so - as transformers' own model tests expect."""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILY_CONFIGS, tiny_config, tiny_model
from transformers import AutoModelForCausalLM

import mindspeed_hf
from mindspeed_hf.releases.compat import sdpa_replaceable, supports_attention_interface


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_explicit_attention_is_kept_and_the_default_becomes_ours(family):
    plain = tiny_model(family)
    hf_default = plain.config._attn_implementation
    mindspeed_hf.enable()
    # (a family whose config asks for eager keeps it, and so does one whose sdpa ours cannot stand in for)
    expected = "mindspeed" if hf_default == "sdpa" and sdpa_replaceable(plain) else hf_default
    assert tiny_model(family).config._attn_implementation == expected
    choice = hf_default  # sdpa, or eager where HF itself has no sdpa path (gemma2)
    model = AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation=choice)
    assert model.config._attn_implementation == choice
    # Switched and back, as transformers' tests do: only models on AttentionInterface can switch (all in
    # transformers 5; 4.57's Qwen2-MoE keeps the attention it was built with, and HF says so with a warning).
    switchable = supports_attention_interface(model)
    for other in ("eager", choice):
        model.set_attn_implementation(other)
        assert model.config._attn_implementation == (other if switchable else choice)
    report = mindspeed_hf.apply_to_model(model)  # what a trainer does with the model it is given
    assert model.config._attn_implementation == choice
    assert report["kernels"]["attention"] == 0 and report["kept"]["attention"] == f"{choice} (requested explicitly)"
    assert any(n for op, n in report["kernels"].items() if op != "attention")  # the other kernels still apply


def test_switching_back_to_ours_and_off_again():
    mindspeed_hf.enable()
    model = tiny_model("qwen3")
    model.set_attn_implementation("eager")
    assert mindspeed_hf.report(model)["kept"] == {"attention": "eager (requested explicitly)"}
    model.set_attn_implementation("mindspeed")
    assert model.config._attn_implementation == "mindspeed" and mindspeed_hf.report(model)["kept"] == {}


def test_explicit_choice_gives_hf_results():
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    plain = tiny_model("llama").eval()
    with torch.no_grad():
        expected = plain(input_ids=ids).logits
    mindspeed_hf.enable()
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="eager").float().eval()
    model.load_state_dict(plain.state_dict())
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert model.config._attn_implementation == "eager"
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_flash_names_taken_only_when_asked():
    """kernels.take_flash_attention: a flash_attention_2 / _3 request (ms-swift's --attn_impl flash_attn for its
    padding-free rows) runs our attention, packed rows kept apart, equal to HF's sdpa on the same packed batch;
    without the setting the request stays HF's (which needs the flash_attn package)."""
    from tiny_models import assert_close_grads, loss_and_grads, packed_batch
    from transformers.utils import is_flash_attn_2_available

    from mindspeed_hf.config import config_from_dict

    batch = packed_batch()
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(tiny_config("qwen3"), attn_implementation="sdpa")
    expected = loss_and_grads(reference, batch)
    mindspeed_hf.enable(config_from_dict({"kernels": {"take_flash_attention": True}}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3"), attn_implementation="flash_attention_2")
    assert model.config._attn_implementation == "mindspeed"
    assert mindspeed_hf.report(model)["kept"] == {}
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)
    model.set_attn_implementation("flash_attention_3")
    assert model.config._attn_implementation == "mindspeed"
    mindspeed_hf.enable(config_from_dict({}))
    if is_flash_attn_2_available():  # a machine with the package: HF's own flash attention is kept
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3"), attn_implementation="flash_attention_2")
        assert model.config._attn_implementation == "flash_attention_2"
        return
    with pytest.raises(ImportError, match="FlashAttention2"):
        AutoModelForCausalLM.from_config(tiny_config("qwen3"), attn_implementation="flash_attention_2")
