"""MoE families: the grouped-GEMM experts kernel as HF's experts implementation (loss and every gradient equal the
unpatched model, fp32 1e-5, with the kernel counted), LoRA on the fused experts (PEFT target_parameters), the
default / explicit / switched-off / disabled choice of experts implementation, and the replaced causal-LM forwards:
HF's signature on every family, router_logits and aux_loss exactly as HF returns them."""

from __future__ import annotations

import inspect

import pytest
import torch
from tiny_models import assert_close_grads, loss_and_grads, modeling_of, padded_batch, tiny_model

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.patches import FAMILIES
from mindspeed_hf.patches import experts as experts_patch
from mindspeed_hf.releases import compat

# VLMs: test_vlm.py; families this release lacks (Qwen3.5-MoE before 5.x) left out
MOE = sorted(name for name, family in FAMILIES.items()
             if family.experts and family.causal_lm and modeling_of(name) is not None)
FUSED = compat.experts_registry() is not None
needs_fused = pytest.mark.skipif(not FUSED, reason="the experts kernel needs transformers >= 5.10 (4.57: one module "
                                 "per expert; 5.0-5.9 accept only their own experts implementations)")


def _experts_modules(model, model_type):
    import importlib

    module = importlib.import_module(FAMILIES[model_type].modeling_module)
    classes = tuple(getattr(module, name) for name in FAMILIES[model_type].experts)
    return [m for m in model.modules() if isinstance(m, classes)]


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []
    original = experts_patch.experts_mlp
    monkeypatch.setattr(experts_patch, "experts_mlp", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@needs_fused
@pytest.mark.parametrize("model_type", MOE)
def test_experts_kernel_is_the_default_and_matches_hf(model_type, backend, kernel_calls):
    batch = padded_batch()
    expected = loss_and_grads(tiny_model(model_type), batch)  # HF's own default experts implementation
    mindspeed_hf.enable(config_from_dict({"backend": backend}))
    model = tiny_model(model_type)
    assert model.config._experts_implementation == experts_patch.EXPERTS_NAME
    report = mindspeed_hf.report(model)
    if backend == "npu":
        assert report["kernels"]["experts"] == len(_experts_modules(model, model_type)) > 0
        assert report["implementations"]["experts"] == "npu:npu_grouped_matmul"
    else:  # the torch backend runs transformers' own grouped_mm, the same algorithm, and says so
        assert report["kernels"]["experts"] == 0 and report["kept"]["experts"] == experts_patch.HF_GROUPED
    loss, grads = loss_and_grads(model, batch)
    assert len(kernel_calls) == report["kernels"]["experts"]
    assert mindspeed_hf.report(model)["ran"]["experts"] == len(kernel_calls)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)


@needs_fused
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_lora_on_fused_experts_matches_hf(model_type, kernel_calls):
    """PEFT adapters on the 3-D expert weights (target_parameters): the kernel runs on W + BA, and the adapters'
    gradients equal the unpatched PEFT model's (HF's usual layout, and GPT-OSS's transposed, biased one; every MoE
    family passed it when this test was written, these three keep the suite short)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=[], init_lora_weights=False,
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    batch = padded_batch()
    expected = loss_and_grads(get_peft_model(tiny_model(model_type), lora), batch)
    model = get_peft_model(tiny_model(model_type), lora)
    mindspeed_hf.enable(config_from_dict({"backend": "npu"}))  # the kernel itself (the torch backend runs HF's)
    experts = mindspeed_hf.apply_to_model(model)["kernels"]["experts"]
    assert experts == len(_experts_modules(model, model_type)) > 0
    loss, grads = loss_and_grads(model, batch)
    assert len(kernel_calls) == experts and grads and all("lora_" in name for name in grads)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)


@needs_fused
def test_explicit_switched_off_and_disabled_choices():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    mindspeed_hf.enable()
    explicit = tiny_model("qwen3_moe", experts_implementation="eager")
    report = mindspeed_hf.apply_to_model(explicit)
    assert explicit.config._experts_implementation == "eager"
    assert report["kernels"]["experts"] == 0 and report["kept"]["experts"] == "eager (requested explicitly)"

    model = tiny_model("qwen3_moe")
    assert model.config._experts_implementation == experts_patch.EXPERTS_NAME
    off = mindspeed_hf.apply_to_model(model, config_from_dict({"kernels": {"experts": False}}))
    assert model.config._experts_implementation == "grouped_mm" and off["kernels"]["experts"] == 0
    mindspeed_hf.apply_to_model(model)
    assert model.config._experts_implementation == experts_patch.EXPERTS_NAME

    mindspeed_hf.disable()
    assert model.config._experts_implementation == "grouped_mm"
    assert experts_patch.EXPERTS_NAME not in ALL_EXPERTS_FUNCTIONS
    model(**padded_batch())  # still runs, on HF's own experts

    mindspeed_hf.enable(config_from_dict({"kernels": {"experts": False}}))
    assert tiny_model("mixtral").config._experts_implementation == "grouped_mm"


@pytest.mark.skipif(FUSED, reason="transformers 4.57 only: its MoE blocks hold one module per expert")
def test_old_release_says_the_experts_kernel_does_not_apply():
    mindspeed_hf.enable()
    report = mindspeed_hf.apply_to_model(tiny_model("qwen3_moe"))
    assert report["kernels"]["experts"] == 0 and report["kept"]["experts"] == experts_patch.UNAVAILABLE


def _causal_lm_classes():
    import importlib

    for model_type, family in sorted(FAMILIES.items()):
        try:
            module = importlib.import_module(family.modeling_module)
        except ImportError:
            continue
        for name in family.causal_lm:
            if hasattr(module, name):
                yield pytest.param(getattr(module, name), id=f"{model_type}-{name}")


@pytest.mark.parametrize("cls", list(_causal_lm_classes()))
def test_patched_forward_publishes_hf_signature(cls):
    original = inspect.signature(cls.forward)
    annotations = dict(cls.forward.__annotations__)
    mindspeed_hf.enable()
    assert cls.forward._mindspeed_op == "fused_linear_cross_entropy"
    assert inspect.signature(cls.forward) == original
    assert cls.forward.__annotations__ == annotations and not isinstance(annotations.get("return"), str)


def _router_families():
    return [t for t in MOE if "output_router_logits" in inspect.signature(
        type(tiny_model(t)).forward).parameters]


@pytest.mark.parametrize("model_type", _router_families())
def test_router_logits_and_aux_loss_as_hf(model_type):
    batch = padded_batch()
    model = tiny_model(model_type)
    model.train()
    expected = model(**batch, output_router_logits=True)
    positional = list(inspect.signature(type(model).forward).parameters).index("output_router_logits") - 1
    mindspeed_hf.enable()
    mindspeed_hf.apply_to_model(model)
    args = [None] * positional + [True]
    args[0], args[1] = batch["input_ids"], batch["attention_mask"]
    args[list(inspect.signature(type(model).forward).parameters).index("labels") - 1] = batch["labels"]
    for out in (model(**batch, output_router_logits=True), model(**batch, output_router_logits=True,
                                                                 skip_logits=True), model(*args)):
        assert type(out) is type(expected)
        torch.testing.assert_close(out.loss, expected.loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.aux_loss, expected.aux_loss, atol=1e-5, rtol=1e-5)
        assert len(out.router_logits) == len(expected.router_logits)
        for got, want in zip(out.router_logits, expected.router_logits):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
