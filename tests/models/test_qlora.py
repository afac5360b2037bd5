"""QLoRA (bitsandbytes 4-bit NF4 + PEFT LoRA, prepare_model_for_kbit_training, gradient checkpointing) with and
without the accelerator: per-step losses and LoRA gradients of plain HF, fp32 compute, 1e-5, on the torch reference
and the NPU path; the kernels run around the quantized projections and the fused loss runs (also over a quantized
lm_head); report() says what runs for the quantized linears; what FSDP2 cannot shard is refused."""

import pytest
import torch

pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (pip install -e .[qlora])")

from qlora_models import qlora_model, save_base, step_batch, train_steps  # noqa: E402
from tiny_models import assert_close_grads  # noqa: E402

import mindspeed_hf  # noqa: E402
from mindspeed_hf.config import config_from_dict  # noqa: E402
from mindspeed_hf.patches import quantized  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return save_base(tmp_path_factory.mktemp("qlora_base"))


def _accelerated(base: str, backend: str, **kwargs):
    """The same QLoRA model built after enable(); `always`: the fused loss runs in this custom loop too."""
    mindspeed_hf.enable(config_from_dict({"backend": backend, "kernels": {"skip_logits": "always"}}))
    model = qlora_model(base, **kwargs)
    return model, mindspeed_hf.apply_to_model(model)


def _assert_same_steps(ref, got) -> None:
    (ref_losses, ref_grads), (losses, grads) = ref, got
    for step, (expected, actual) in enumerate(zip(ref_losses, losses)):
        torch.testing.assert_close(actual, expected, **TOL, msg=lambda m, s=step: f"step {s} loss: {m}")
    for expected, actual in zip(ref_grads, grads):
        assert expected and all("lora_" in name for name in expected)  # only the adapters train
        assert_close_grads(expected, actual)


@pytest.mark.parametrize("gradient_checkpointing", [True, False])
def test_qlora_parity(base, backend, gradient_checkpointing):
    reference = train_steps(qlora_model(base, gradient_checkpointing=gradient_checkpointing))
    model, report = _accelerated(base, backend, gradient_checkpointing=gradient_checkpointing)
    kernels = report["kernels"]
    assert (kernels["rms_norm"], kernels["swiglu"], kernels["attention"], kernels["rope"]) == (9, 2, 2, 2)
    assert kernels["fused_linear_cross_entropy"] == 1 and report["skip_logits"] == "always"
    assert report["quantized_linear"] == {
        "modules": 14, "quant_type": ["nf4"], "double_quant": True, "quant_storage": ["uint8"],
        "compute_dtype": ["float32"], "implementation": "bitsandbytes:cpu"}
    layer = model.base_model.model.model.layers[0]
    assert type(layer.mlp.gate_proj.base_layer).__name__ == "Linear4bit"  # what the SwiGLU forward calls
    _assert_same_steps(reference, train_steps(model))


def test_quantized_lm_head_goes_through_the_module(base, backend):
    """A 4-bit lm_head (llm_int8_skip_modules=[]) holds packed bytes, not a [vocab, hidden] weight: the fused loss
    calls it as a module per chunk instead of reading its weight."""
    reference = train_steps(qlora_model(base, quantize_lm_head=True), steps=2)
    model, report = _accelerated(base, backend, quantize_lm_head=True)
    assert type(model.base_model.model.lm_head).__name__ == "Linear4bit"
    assert report["kernels"]["fused_linear_cross_entropy"] == 1 and report["quantized_linear"]["modules"] == 15
    _assert_same_steps(reference, train_steps(model, steps=2))


def test_bf16_compute(base, backend):
    """bf16 compute (prepare_model_for_kbit_training keeps the norms and embeddings in fp32): same output dtypes
    as plain HF, loss within bf16 noise, gradients for every adapter."""
    batch = step_batch(0)
    plain = qlora_model(base, compute_dtype=torch.bfloat16)
    ref = plain(**batch)
    mindspeed_hf.enable(config_from_dict({"backend": backend}))
    model = qlora_model(base, compute_dtype=torch.bfloat16)
    mindspeed_hf.apply_to_model(model)
    out = model(**batch)
    assert out.logits.dtype == ref.logits.dtype and out.loss.dtype == ref.loss.dtype
    torch.testing.assert_close(out.loss, ref.loss, atol=2e-2, rtol=2e-2)
    out.loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def test_kernel_for_each_device():
    """What bitsandbytes dispatches, read from torch's dispatcher: its own CPU kernel here; on a device it has no
    backend for (Ascend npu) its pure-torch "default" kernel, since torch_npu has no NF4 op."""
    assert quantized.kernel_for("cpu") == "bitsandbytes:cpu"
    npu = quantized.kernel_for("npu")
    assert npu.startswith("bitsandbytes:default (pure-torch") and "torch_npu has no NF4 kernel" in npu


def test_report_without_quantized_layers():
    from tiny_models import tiny_model

    mindspeed_hf.enable()
    assert mindspeed_hf.apply_to_model(tiny_model("qwen3"))["quantized_linear"] is None


def test_fsdp_refuses_what_it_cannot_shard(base):
    """Checked before anything is sharded (apply_fsdp calls check_fsdp first): a floating-point 4-bit storage
    under a different mixed-precision dtype, and 8-bit layers. What FSDP2 can shard passes."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    fp32_storage = qlora_model(base, quant_storage=torch.float32, gradient_checkpointing=False)
    with pytest.raises(ValueError, match=r"param_dtype=torch.bfloat16.*bnb_4bit_quant_storage=torch.uint8"):
        quantized.check_fsdp(fp32_storage, torch.bfloat16)
    quantized.check_fsdp(fp32_storage, None)
    quantized.check_fsdp(fp32_storage, torch.float32)
    quantized.check_fsdp(qlora_model(base, gradient_checkpointing=False), torch.bfloat16)  # uint8: never cast
    eight = AutoModelForCausalLM.from_pretrained(base, quantization_config=BitsAndBytesConfig(load_in_8bit=True),
                                                 device_map="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"8-bit layers.*load_in_4bit=True"):
        quantized.check_fsdp(eight, None)


def test_mixed_precision_forward_wrapper(base):
    """bf16/fp16 Trainer runs (QLoRA's usual `bf16=True`): accelerate wraps the model's forward on the instance with
    autocast + convert_to_fp32, which probes every output for a dtype. The skipped logits pass through it (one
    training step used to fail there), and report() still counts the fused loss under the wrapper."""
    from accelerate.utils.operations import convert_outputs_to_fp32

    mindspeed_hf.enable(config_from_dict({"kernels": {"skip_logits": "always"}}))
    model = qlora_model(base, compute_dtype=torch.bfloat16, gradient_checkpointing=False)
    hf_model = model.base_model.model
    hf_model.forward = convert_outputs_to_fp32(torch.autocast("cpu", dtype=torch.bfloat16)(hf_model.forward))
    assert mindspeed_hf.report(model)["kernels"]["fused_linear_cross_entropy"] == 1
    out = model(**step_batch(0))
    out.loss.backward()
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    assert not hasattr(out.logits, "dtype")
    with pytest.raises(RuntimeError, match="kernels.skip_logits=always"):
        out.logits.float()
