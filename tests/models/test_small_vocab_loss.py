"""A head whose vocabulary is no larger than its hidden size keeps HF's loss on the torch backend (the chunked loss
would save no memory there and cost host time): plain HF's loss and gradients bit for bit, report() says so and
counts no fused run, and the npu path keeps its fused kernel."""

from __future__ import annotations

import torch
from tiny_models import padded_batch, tiny_model

import mindspeed_hf
from mindspeed_hf.ops import registry

OP = "fused_linear_cross_entropy"


def _batch() -> dict[str, torch.Tensor]:
    """padded_batch with its token ids folded into a 32-token vocabulary (labels -100 on pads kept)."""
    batch = padded_batch()
    ids = batch["input_ids"] % 32
    return {**batch, "input_ids": ids, "labels": ids.masked_fill(batch["labels"] == -100, -100)}


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_small_vocabulary_keeps_hf_loss_on_the_torch_backend():
    batch = _batch()
    reference = tiny_model("qwen3", vocab_size=32).train()  # hidden 64
    want, want_grads = _loss_and_grads(reference, batch)

    mindspeed_hf.enable()
    model = tiny_model("qwen3", vocab_size=32).train()
    mindspeed_hf.apply_to_model(model)
    out, grads = _loss_and_grads(model, batch)

    assert torch.equal(out.loss, want.loss) and torch.equal(out.logits, want.logits)
    assert all(torch.equal(grads[n], want_grads[n]) for n in want_grads)
    report = mindspeed_hf.report(model)
    assert report["kernels"][OP] == report["ran"][OP] == 0, report
    assert "vocabulary 32 <= hidden size 64" in report["kept"][OP], report
    assert report["ran"]["rms_norm"] > 0  # the other kernels still run


def test_npu_path_and_larger_vocabulary_keep_the_fused_loss():
    mindspeed_hf.enable()
    batch = _batch()
    for backend, vocab in (("npu", 32), ("torch", 128)):
        registry.set_backend(backend)
        model = tiny_model("qwen3", vocab_size=vocab).train()
        mindspeed_hf.apply_to_model(model)
        model(**batch).loss.backward()
        report = mindspeed_hf.report(model)
        assert report["ran"][OP] == 1 and OP not in report["kept"], (backend, report)
