"""fused_linear_cross_entropy against HF's own ForCausalLMLoss on the full logits of the same lm_head."""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import sys
import types

import pytest
import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from mindspeed_hf.ops import fused_linear_cross_entropy as flce_mod
from mindspeed_hf.ops.fused_linear_cross_entropy import default_chunk_size, fused_linear_cross_entropy
from mindspeed_hf.ops.registry import implementation

B, S, H, V, CHUNK = 3, 37, 48, 1001, 16
TOL = dict(atol=1e-5, rtol=1e-5)


def _labels(seed: int = 0, batch: int = B) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (batch, S), generator=gen)
    labels[0, :5] = -100  # a masked prompt
    labels[-1, 20:] = -100  # right padding
    labels[1, 7] = -100
    return labels


def _head(bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(H, V, bias=bias)


def _hidden(seed: int = 1, batch: int = B) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, S, H, generator=gen).requires_grad_()


def _hf_loss(hidden, head, labels, softcap=None, **kwargs):
    logits = head(hidden)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return ForCausalLMLoss(logits, labels, V, **kwargs)


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=True)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("with_items", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_hf_loss_and_grads(backend, softcap, with_items, bias):
    head, hidden, labels = _head(bias), _hidden(), _labels()
    items = {"num_items_in_batch": torch.tensor(71)} if with_items else {}
    params = [hidden, *head.parameters()]
    ref = _hf_loss(hidden, head, labels, softcap, **items)
    out = fused_linear_cross_entropy(hidden, head, labels, softcap=softcap, chunk_size=CHUNK, **items)
    assert out.dtype == torch.float32 and out.dim() == 0
    torch.testing.assert_close(out, ref, **TOL)
    for expected, actual in zip(_grads(ref, params), _grads(out, params)):
        torch.testing.assert_close(actual, expected, **TOL)


def test_weight_tensor_default_chunk_and_shift_labels(backend):
    head, hidden, labels = _head(), _hidden(), _labels()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    shifted[2, 3] = -100  # a collator's own (e.g. context-parallel) shifted labels are taken as given
    ref = _hf_loss(hidden, head, None, shift_labels=shifted)
    out = fused_linear_cross_entropy(hidden, head.weight, None, shift_labels=shifted)
    torch.testing.assert_close(out, ref, **TOL)
    for expected, actual in zip(_grads(ref, [hidden, head.weight]), _grads(out, [hidden, head.weight])):
        torch.testing.assert_close(actual, expected, **TOL)


def test_gradient_accumulation_equals_one_batch():
    """4 micro-batches with uneven valid counts and Trainer's num_items_in_batch sum to the one-batch gradient."""
    head, hidden, labels = _head(), _hidden(batch=4), _labels(batch=4)
    labels[2, 10:] = -100
    ref = _hf_loss(hidden, head, labels)  # one batch: mean over all valid tokens
    ref_grads = _grads(ref, [hidden, head.weight])
    items = (labels[..., 1:] != -100).sum()  # what Trainer counts over the accumulated micro-batches
    total = 0.0
    for i in range(4):
        total = total + fused_linear_cross_entropy(hidden[i : i + 1], head, labels[i : i + 1], chunk_size=CHUNK,
                                                   num_items_in_batch=items)
    torch.testing.assert_close(total, ref, **TOL)
    for expected, actual in zip(ref_grads, _grads(total, [hidden, head.weight])):
        torch.testing.assert_close(actual, expected, **TOL)


def test_tied_embeddings():
    torch.manual_seed(0)
    embed, head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
    head.weight = embed.weight
    ids, labels = torch.randint(0, V, (B, S)), _labels()
    mix = nn.Linear(H, H)

    def hidden():
        return torch.tanh(mix(embed(ids)))

    ref = _hf_loss(hidden(), head, labels)
    out = fused_linear_cross_entropy(hidden(), head, labels, chunk_size=CHUNK)
    params = [embed.weight, mix.weight]
    torch.testing.assert_close(out, ref, **TOL)
    for expected, actual in zip(_grads(ref, params), _grads(out, params)):
        torch.testing.assert_close(actual, expected, **TOL)


def _lora_lm_head(r: int) -> nn.Module:
    """A PEFT LoRA adapter (non-zero from the start) on a bare lm_head."""
    peft = pytest.importorskip("peft")

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(H, V, bias=False)

    model = peft.get_peft_model(Head(), peft.LoraConfig(r=r, target_modules=["lm_head"], init_lora_weights=False))
    return model.base_model.model.lm_head


def test_lora_on_lm_head_takes_part():
    torch.manual_seed(0)
    lm_head = _lora_lm_head(r=4)
    hidden, labels = _hidden(), _labels()
    lora = [p for n, p in lm_head.named_parameters() if "lora_" in n]
    assert len(lora) == 2
    ref = _hf_loss(hidden, lm_head, labels)
    out = fused_linear_cross_entropy(hidden, lm_head, labels, chunk_size=CHUNK)
    torch.testing.assert_close(out, ref, **TOL)
    for expected, actual in zip(_grads(ref, [hidden, *lora]), _grads(out, [hidden, *lora])):
        assert actual is not None
        torch.testing.assert_close(actual, expected, **TOL)


def test_no_valid_token_is_nan_like_hf_with_zero_grads():
    head, hidden = _head(), _hidden()
    labels = torch.full((B, S), -100)
    for items in ({}, {"num_items_in_batch": torch.tensor(0)}):
        ref = _hf_loss(hidden, head, labels, **items)
        out = fused_linear_cross_entropy(hidden, head, labels, **items)
        assert torch.isnan(ref) and torch.isnan(out)
        for grad in _grads(out, [hidden, head.weight]):
            assert torch.count_nonzero(grad) == 0


def test_no_grad_and_frozen_weight():
    head, hidden, labels = _head(), _hidden(), _labels()
    ref = _hf_loss(hidden, head, labels)
    with torch.no_grad():
        torch.testing.assert_close(fused_linear_cross_entropy(hidden, head, labels, chunk_size=CHUNK), ref, **TOL)
    head.weight.requires_grad_(False)  # LoRA elsewhere, frozen lm_head: only the hidden gradient is built
    out = fused_linear_cross_entropy(hidden, head, labels, chunk_size=CHUNK)
    torch.testing.assert_close(_grads(out, [hidden])[0], _grads(ref, [hidden])[0], **TOL)
    assert head.weight.grad is None


def test_bf16_loose():
    head, hidden, labels = _head().bfloat16(), _hidden().detach().bfloat16().requires_grad_(), _labels()
    ref = _hf_loss(hidden, head, labels)
    out = fused_linear_cross_entropy(hidden, head, labels, chunk_size=CHUNK)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)
    for expected, actual in zip(_grads(ref, [hidden, head.weight]), _grads(out, [hidden, head.weight])):
        assert actual.dtype == torch.bfloat16
        torch.testing.assert_close(actual.float(), expected.float(), atol=2e-3, rtol=5e-2)


def test_backward_twice_is_refused():
    head, hidden, labels = _head(), _hidden(), _labels()
    out = fused_linear_cross_entropy(hidden, head, labels, chunk_size=CHUNK)
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.backward()


def test_registry_and_default_chunk(backend):
    name = implementation("fused_linear_cross_entropy", "cpu")
    assert name == ("torch" if backend == "torch" else "npu:npu_cross_entropy_loss")
    assert default_chunk_size(151936) == 512
    assert 64 <= default_chunk_size(1001) <= 8192
    assert default_chunk_size(32000) == 2430 and default_chunk_size(32000, cpu_weight=True) == 512
    assert default_chunk_size(151936, cpu_weight=True) == 512


def test_a_cpu_weight_is_chunked_by_at_most_512_rows_and_matches_hf(backend, monkeypatch):
    """Default chunking of a local CPU weight: 1,100 rows of a 2,000-word vocabulary (one block by the budget
    alone) in three chunks, and HF's loss and gradients."""
    monkeypatch.setattr(flce_mod, "SMALL_BLOCK_ELEMENTS", 0)  # chunk this small forward too
    rows = []
    step = flce_mod._chunk_step
    monkeypatch.setattr(flce_mod, "_chunk_step", lambda h, *a: rows.append(h.shape[0]) or step(h, *a))
    torch.manual_seed(0)
    head = nn.Linear(H, 2000, bias=False)
    hidden = torch.randn(2, 551, H, requires_grad=True)
    labels = torch.randint(0, 2000, (2, 551))
    ours = fused_linear_cross_entropy(hidden, head.weight, labels)
    (grad_h,) = torch.autograd.grad(ours, hidden)
    assert rows == [512, 512, 76], rows
    ref = ForCausalLMLoss(head(hidden), labels, vocab_size=2000)
    (ref_h,) = torch.autograd.grad(ref, hidden)
    torch.testing.assert_close(ours, ref, **TOL)
    torch.testing.assert_close(grad_h, ref_h, **TOL)


# ---------------------------------------------------------------------------------- ZeRO-3 (numel 0) weights
@contextlib.contextmanager
def _fake_deepspeed(full: torch.Tensor):
    """A stand-in `deepspeed.zero.GatheredParameters` that gathers by swapping the full data in and out."""

    @contextlib.contextmanager
    def gathered(params, modifier_rank=None):
        params[0].data = full
        yield
        params[0].data = torch.empty(0)

    module = types.ModuleType("deepspeed")
    module.__spec__ = importlib.machinery.ModuleSpec("deepspeed", None)
    module.zero = types.SimpleNamespace(GatheredParameters=gathered)
    saved = sys.modules.get("deepspeed")
    sys.modules["deepspeed"] = module
    try:
        yield
    finally:
        if saved is None:
            sys.modules.pop("deepspeed", None)
        else:
            sys.modules["deepspeed"] = saved


def test_zero3_empty_weight():
    head, hidden, labels = _head(), _hidden(), _labels()
    ref = _hf_loss(hidden, head, labels)
    full = head.weight.data
    head.weight.data = torch.empty(0)
    head.weight.ds_id = 7
    # a hooked ZeRO-3 module is called per chunk (DeepSpeed's hooks gather it); a bare empty tensor gathers
    assert flce_mod._resolve_head(head)[0] == "module"
    with _fake_deepspeed(full), torch.no_grad():
        torch.testing.assert_close(fused_linear_cross_entropy(hidden, head.weight, labels), ref, **TOL)
    with pytest.raises(RuntimeError, match="needs a gradient"):
        fused_linear_cross_entropy(hidden, head.weight, labels)
    if importlib.util.find_spec("deepspeed") is None:  # not installed (CI installs it: the real one needs real params)
        with pytest.raises(RuntimeError, match="deepspeed cannot be imported"), torch.no_grad():
            fused_linear_cross_entropy(hidden, head.weight, labels)
    del head.weight.ds_id
    with pytest.raises(RuntimeError, match="not a DeepSpeed ZeRO-3 parameter"):
        fused_linear_cross_entropy(hidden, head, labels)


def test_lora_head_with_no_valid_token():
    hidden, labels = _hidden(), torch.full((B, S), -100)
    out = fused_linear_cross_entropy(hidden, _lora_lm_head(r=2), labels)
    assert torch.isnan(out)
    out.backward()
    assert torch.count_nonzero(hidden.grad) == 0


def test_fsdp2_sharded_lm_head_is_called_per_chunk():
    """A fully_shard-ed lm_head (weight a DTensor) goes through the module path: FSDP's hooks unshard it on
    every chunk call and its gradient lands on the sharded parameter (one-rank gloo group, in process)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group already set up")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    head, ref_head = _head(), _head()
    hidden, labels = _hidden(), _labels()
    ref = _hf_loss(hidden, ref_head, labels)
    ref_grads = _grads(ref, [hidden, ref_head.weight])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fully_shard(head, mesh=init_device_mesh("cpu", (1,)))
        assert flce_mod._resolve_head(head)[0] == "module"
        out = fused_linear_cross_entropy(hidden, head, labels, chunk_size=CHUNK)
        out.backward()
        torch.testing.assert_close(out, ref, **TOL)
        torch.testing.assert_close(hidden.grad, ref_grads[0], **TOL)
        torch.testing.assert_close(head.weight.grad.full_tensor(), ref_grads[1], **TOL)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("with_items", [False, True])
def test_small_block_on_the_torch_path_is_hf_exactly(backend, with_items, monkeypatch):
    """The torch path with the default chunk size computes a forward of at most SMALL_BLOCK_ELEMENTS logits as one
    block with autograd's ops: HF's loss and gradients bit for bit. A larger forward, an explicit chunk size and the
    npu path run the chunked Function."""
    chunked = []
    apply = flce_mod._ChunkedLinearCE.apply
    monkeypatch.setattr(flce_mod._ChunkedLinearCE, "apply", lambda *a: chunked.append(1) or apply(*a))
    head, hidden, labels = _head(), _hidden(), _labels()
    items = {"num_items_in_batch": torch.tensor(71)} if with_items else {}
    params = [hidden, head.weight]
    assert B * S * V <= flce_mod.SMALL_BLOCK_ELEMENTS
    ref = _hf_loss(hidden, head, labels, **items)
    out = fused_linear_cross_entropy(hidden, head, labels, **items)
    if backend == "torch":
        assert not chunked and torch.equal(out, ref)
        assert all(torch.equal(a, e) for a, e in zip(_grads(out, params), _grads(ref, params)))
    else:
        assert chunked == [1]
        torch.testing.assert_close(out, ref, **TOL)
    fused_linear_cross_entropy(hidden, head, labels, chunk_size=CHUNK, **items)
    monkeypatch.setattr(flce_mod, "SMALL_BLOCK_ELEMENTS", B * S * V - 1)
    torch.testing.assert_close(fused_linear_cross_entropy(hidden, head, labels, **items), ref, **TOL)
    assert len(chunked) == (2 if backend == "torch" else 3)  # the explicit chunk size and the larger forward chunk
