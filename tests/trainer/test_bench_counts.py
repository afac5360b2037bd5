"""The device-independent proxies of `mindspeed-hf bench` (bench/counts.py), counted on tiny models in this
process against plain Hugging Face: the same code gives the same counts, and the npu path (through the stand-in)
dispatches fewer kernels than plain HF, one torch_npu call per patched site."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, tiny_model

import mindspeed_hf
from mindspeed_hf.bench.counts import count_model_step
from mindspeed_hf.config import config_from_dict

BATCH, SEQ = 2, 32


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def _counts(family: str, backend: str | None) -> tuple[dict, dict]:
    """(counts of one training step, report) for `family`'s tiny model: plain HF, or accelerated on `backend`."""
    model = tiny_model(family).train()
    report = {}
    if backend is not None:
        report = mindspeed_hf.apply_to_model(model, config_from_dict({"backend": backend}))
    return count_model_step(model, _batch()), report


def test_counts_are_deterministic():
    first, _ = _counts("qwen3", None)
    assert first == _counts("qwen3", None)[0]
    npu, _ = _counts("qwen3", "npu")
    assert npu == _counts("qwen3", "npu")[0]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_npu_path_dispatches_fewer_kernels_than_plain_hf(family):
    plain, _ = _counts(family, None)
    npu, report = _counts(family, "npu")
    norms = report["kernels"]["rms_norm"]
    assert plain["npu_calls"] == 0 and plain["aten_by_op"]["aten.rsqrt"] == norms  # HF's RMSNorm: one rsqrt each
    # one npu_rms_norm (or, where the residual add is fused in, npu_add_rms_norm) per norm site in the forward, one
    # backward kernel each; no norm math left in aten ops
    calls = npu["npu_by_op"]
    assert calls["npu_rms_norm"] + calls.get("npu_add_rms_norm", 0) == norms
    assert calls["npu_rms_norm.backward"] + calls.get("npu_rms_norm_backward", 0) == norms
    assert "aten.rsqrt" not in npu["aten_by_op"]
    assert npu["aten_ops"] + npu["npu_calls"] < 0.85 * plain["aten_ops"], (npu["aten_ops"], plain["aten_ops"])


def test_largest_allocation_and_saved_bytes_are_measured():
    plain, _ = _counts("llama", None)
    logits = BATCH * SEQ * VOCAB * 4  # fp32 [batch, seq, vocab]: plain HF's largest tensor in this tiny model
    assert plain["largest_alloc_bytes"] == logits
    assert plain["saved_bytes"] >= logits and plain["saved_tensors"] > 0
