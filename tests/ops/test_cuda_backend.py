"""The CUDA path (liger-kernel where installed, torch otherwise) against HF's own eager code on a GPU.
Skipped, with the reason shown, where no CUDA device exists; benchmarks/gpu_check.sh runs it on a GPU."""

import pytest
import torch
from tiny_models import assert_close_grads, loss_and_grads, packed_batch, padded_batch, tiny_model
from transformers.models.llama import modeling_llama

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.ops import apply_rotary_pos_emb, implementation, rms_norm, swiglu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_ops_match_hf(dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 37, 96, device="cuda", dtype=dtype, requires_grad=True)
    norm = modeling_llama.LlamaRMSNorm(96).to("cuda", dtype)
    torch.testing.assert_close(rms_norm(x, norm.weight, norm.variance_epsilon), norm(x), **TOL[dtype])
    q = torch.randn(2, 6, 37, 64, device="cuda", dtype=dtype)
    k = torch.randn(2, 2, 37, 64, device="cuda", dtype=dtype)
    emb = torch.randn(2, 37, 32, device="cuda").repeat(1, 1, 2)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    for ours, ref in zip(apply_rotary_pos_emb(q, k, cos, sin), modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)):
        torch.testing.assert_close(ours, ref, **TOL[dtype])
    gate, up = torch.randn(2, 2, 37, 96, device="cuda", dtype=dtype).unbind(0)
    torch.testing.assert_close(swiglu(gate, up), torch.nn.functional.silu(gate) * up, **TOL[dtype])
    print({op: implementation(op, "cuda") for op in ("rms_norm", "rope", "swiglu", "attention")})


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe"])
def test_cuda_family_parity(model_type):
    model = tiny_model(model_type).cuda()
    batches = [{k: v.cuda() if torch.is_tensor(v) else v for k, v in make().items()}
               for make in (padded_batch, packed_batch)]
    expected = [loss_and_grads(model, b) for b in batches]
    mindspeed_hf.enable(config_from_dict({"backend": "cuda"}))
    assert mindspeed_hf.apply_to_model(model)["backend"] == "cuda"
    for batch, (loss_ref, grads_ref) in zip(batches, expected, strict=True):
        loss, grads = loss_and_grads(model, batch)
        torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
        assert_close_grads(grads_ref, grads, atol=1e-4, rtol=1e-4)  # liger's fp32 kernels reorder sums
