"""attn_implementation="mindspeed" against plain HF ("sdpa" and eager), on the torch backend and on the npu
backend through the torch_npu stand-in (the conftest puts it on sys.path and provides the `backend` fixture)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from tiny_models import assert_close_grads, loss_and_grads, packed_batch, padded_batch, tiny_config
from torch import nn
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    AttentionMaskInterface,
    create_causal_mask,
    create_sliding_window_causal_mask,
)
from transformers.modeling_utils import AttentionInterface
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager

from mindspeed_hf.device import import_torch_npu
from mindspeed_hf.ops import attention, varlen
from mindspeed_hf.releases.compat import create_mask, unpacked_batches_get_sequence_ids

B, S, NQ, NKV, D = 3, 37, 6, 2, 24
SCALE = 0.17  # not 1/sqrt(D): the scale must be passed explicitly (the op's default is 1.0)
WINDOW = 8


@pytest.fixture(autouse=True)
def _registered():
    attention.register_attention()
    varlen.clear_cache()
    yield
    attention.unregister_attention()


class _Attn(nn.Module):
    """What HF's attention functions read from the module."""

    def __init__(self, groups: int = NQ // NKV):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True
        self.head_dim = D
        self.eval()


def _qkv(batch=B, seq=S, nq=NQ, nkv=NKV, dim=D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, n, seq, dim, generator=gen).requires_grad_() for n in (nq, nkv, nkv)]


def _case(name: str):
    """(2-D padding mask or None, position_ids or None, sliding window or None, [B, S] valid query positions)."""
    padding = position_ids = window = None
    batch, seq = B, S
    if name in ("right", "left", "sliding_left"):
        padding = torch.zeros(batch, seq, dtype=torch.long)
        for row, length in enumerate((seq, seq - 7, seq - 16)):
            if name == "right":
                padding[row, :length] = 1
            else:
                padding[row, seq - length:] = 1
    if name in ("holes", "sliding_holes"):  # padding inside rows (not left/right): distances change when unpadded
        padding = torch.ones(batch, seq, dtype=torch.long)
        padding[0, 10:14] = 0
        padding[2, :3] = padding[2, 20:] = 0
    if name in ("packed", "sliding_packed"):
        batch, seq = 2, 15
        rows = [[5, 7, 3], [9, 6]]  # [0..4, 0..6, 0..2] in one row, two sequences in the other
        position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    if name.startswith("sliding"):
        window = WINDOW
    valid = torch.ones(batch, seq, dtype=torch.bool) if padding is None else padding.bool()
    return padding, position_ids, window, valid, batch, seq


def _mask(impl, padding, position_ids, window, batch, seq, dtype=torch.float32):
    """The mask HF's model code builds for `impl` (create_causal_mask / create_sliding_window_causal_mask)."""
    config = LlamaConfig(hidden_size=NQ * D, num_attention_heads=NQ, num_key_value_heads=NKV, sliding_window=window)
    config._attn_implementation = impl
    build = create_sliding_window_causal_mask if window else create_causal_mask
    embeds = torch.zeros(batch, seq, 1, dtype=dtype)
    return create_mask(build, config, embeds, padding, position_ids)


def _run(impl, fn, qkv, case, **extra):
    padding, position_ids, window, valid, batch, seq = case
    q, k, v = qkv
    mask = _mask(impl, padding, position_ids, window, batch, seq, q.dtype)
    out, _ = fn(_Attn(), q, k, v, mask, scaling=SCALE, sliding_window=window, position_ids=position_ids, **extra)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
    (out * weight)[valid].sum().backward()
    grads = [t.grad.detach().clone() for t in qkv]
    for t in qkv:
        t.grad = None
    return out.detach()[valid], grads


CASES = ["causal", "right", "left", "holes", "packed", "sliding", "sliding_left", "sliding_packed", "sliding_holes"]


@pytest.mark.parametrize("name", CASES)
def test_op_matches_hf_sdpa_fp32(backend, name, monkeypatch):
    case = _case(name)
    qkv = _qkv(case[4], case[5])
    expected, expected_grads = _run("sdpa", sdpa_attention_forward, qkv, case)
    counts = _count_calls(monkeypatch) if backend == "npu" else None
    out, grads = _run(attention.ATTENTION_NAME, attention.attention_forward, qkv, case)
    if counts is not None:  # really the fused op, not a fallback: dense BSND without padding/packing, else TND
        layouts = {"causal": ["BSND"], "sliding": ["BSND"], "sliding_holes": []}  # a band cannot skip holes
        assert counts["layouts"] == layouts.get(name, ["TND"])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _hf_then_ours_sdpa_calls(qkv, case, monkeypatch):
    """(HF's sdpa result, ours, the (key heads, enable_gqa) of each SDPA call ours made)."""
    expected = _run("sdpa", sdpa_attention_forward, qkv, case)
    calls, real = [], torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: calls.append((k.shape[1], kw.get("enable_gqa"))) or real(q, k, v, **kw))
    return expected, _run(attention.ATTENTION_NAME, attention.attention_forward, qkv, case), calls


@pytest.mark.parametrize("name", ["right", "holes", "packed", "sliding_left"])
def test_torch_masked_gqa_shares_kv_heads(name, monkeypatch):
    """On CPU a masked call hands SDPA the key/value heads unrepeated (enable_gqa), where HF's sdpa repeats them:
    HF's outputs, gradients within fp32 rounding, and no repeated keys/values kept for the backward."""
    case = _case(name)
    qkv = _qkv(case[4], case[5])
    (expected, expected_grads), (out, grads), calls = _hf_then_ours_sdpa_calls(qkv, case, monkeypatch)
    assert calls == [(NKV, True)]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_torch_masked_gqa_bf16_keeps_hf_repeat(monkeypatch):
    """In bf16 HF's repeated heads run (their per-head gradient roundings are HF's): the same bits as HF's sdpa."""
    case = _case("right")
    qkv = [t.detach().to(torch.bfloat16).requires_grad_() for t in _qkv(case[4], case[5])]
    (expected, expected_grads), (out, grads), calls = _hf_then_ours_sdpa_calls(qkv, case, monkeypatch)
    assert calls == [(NQ, None)]
    assert torch.equal(out, expected) and all(torch.equal(a, b) for a, b in zip(grads, expected_grads))


def test_torch_masked_gqa_with_dropout_keeps_hf_repeat(monkeypatch):
    """With attention dropout HF's repeated heads run: its random mask is drawn by HF's kernel call."""
    case = _case("right")
    calls, real = [], torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: calls.append((k.shape[1], kw.get("enable_gqa"))) or real(q, k, v, **kw))
    _run(attention.ATTENTION_NAME, attention.attention_forward, _qkv(case[4], case[5]), case, dropout=0.1)
    assert calls == [(NQ, None)]


@pytest.mark.parametrize("name", ["left", "sliding"])
def test_op_matches_hf_eager_fp32(backend, name):
    case = _case(name)
    qkv = _qkv(case[4], case[5])
    expected, expected_grads = _run("eager", llama_eager, qkv, case)
    out, grads = _run(attention.ATTENTION_NAME, attention.attention_forward, qkv, case)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["causal", "left", "sliding_packed"])
def test_op_bf16_npu(name):
    from mindspeed_hf.ops import registry

    registry.set_backend("npu")
    case = _case(name)
    qkv = _qkv(case[4], case[5])
    expected, expected_grads = _run("sdpa", sdpa_attention_forward, qkv, case)
    low = [t.detach().bfloat16().requires_grad_() for t in qkv]
    out, grads = _run(attention.ATTENTION_NAME, attention.attention_forward, low, case)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=2e-2)


def test_npu_mask_expands_on_the_torch_path():
    """A compact 2-D npu mask that reaches the torch kernel (backend changed in between) is expanded, not misread.
    (A None mask keeps SDPA's meaning there: HF's sdpa builder returns None only when the window covers all keys.)"""
    from mindspeed_hf.ops import registry

    for name in ("left", "sliding_packed", "sliding_left"):
        padding, position_ids, window, valid, batch, seq = case = _case(name)
        qkv = _qkv(batch, seq)
        expected, _ = _run("sdpa", sdpa_attention_forward, qkv, case)
        registry.set_backend("npu")
        mask = _mask(attention.ATTENTION_NAME, padding, position_ids, window, batch, seq)
        assert mask is None or mask.dim() == 2  # compact: no [B, 1, S, S] tensor on the npu path
        registry.set_backend("torch")
        out, _ = attention.attention_forward(_Attn(), *qkv, mask, scaling=SCALE, sliding_window=window)
        torch.testing.assert_close(out.detach()[valid], expected, atol=1e-5, rtol=1e-5)
        registry.set_backend(None)


def test_npu_falls_back_for_what_the_op_cannot_do(caplog):
    """softcap, head_dim > 768, output_attentions, custom 4-D masks: correct results on the torch path."""
    from mindspeed_hf.ops import registry

    registry.set_backend("npu")
    case = _case("left")
    padding, position_ids, window, valid, batch, seq = case
    qkv = _qkv(batch, seq)
    eager_mask = _mask("eager", padding, None, None, batch, seq)
    with caplog.at_level(logging.WARNING, logger="mindspeed_hf"):
        for _ in range(2):
            expected, _ = gemma2_eager(_Attn(), *qkv, eager_mask, scaling=SCALE, softcap=5.0)
            out, _ = _run(attention.ATTENTION_NAME, attention.attention_forward, qkv, case, softcap=5.0)
            torch.testing.assert_close(out, expected.detach()[valid], atol=1e-5, rtol=1e-5)
    assert sum("softcap" in r.getMessage() for r in caplog.records) == 1  # warned once

    expected, weights = llama_eager(_Attn(), *qkv, eager_mask, scaling=SCALE)
    out, got_weights = attention.attention_forward(_Attn(), *qkv, _mask(attention.ATTENTION_NAME, padding, None, None,
                                                   batch, seq), scaling=SCALE, output_attentions=True)
    torch.testing.assert_close(out[valid], expected[valid], atol=1e-5, rtol=1e-5)
    assert got_weights is not None and got_weights.shape == weights.shape

    sdpa_mask = _mask("sdpa", padding, None, None, batch, seq)  # a custom 4-D bool mask
    expected, _ = sdpa_attention_forward(_Attn(), *qkv, sdpa_mask, scaling=SCALE)
    out, _ = attention.attention_forward(_Attn(), *qkv, sdpa_mask, scaling=SCALE)
    torch.testing.assert_close(out[valid], expected[valid], atol=1e-5, rtol=1e-5)

    big = _qkv(2, 5, 2, 1, 776)
    module = _Attn(groups=2)
    expected, _ = sdpa_attention_forward(module, *big, None, scaling=SCALE)
    out, _ = attention.attention_forward(module, *big, None, scaling=SCALE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------- models


def _batch(kind: str) -> dict:
    if kind == "packed":
        return {**packed_batch(), "use_cache": False}  # HF detects packing only without a cache
    return {**padded_batch(left=kind == "left"), "use_cache": False}


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_model_loss_and_grads_match_sdpa(backend, model_type):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="mindspeed").float()
    assert model.config._attn_implementation == "mindspeed"
    for kind in ("right", "left", "packed"):
        batch = _batch(kind)
        model.set_attn_implementation("sdpa")
        loss_ref, grads_ref = loss_and_grads(model, batch)
        model.set_attn_implementation(attention.ATTENTION_NAME)
        loss, grads = loss_and_grads(model, batch)
        torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
        assert_close_grads(grads_ref, grads)


@pytest.mark.parametrize("model_type", ["qwen2", "gemma3_text", "gemma2"])
def test_sliding_window_models_match_hf(backend, model_type):
    """Sliding layers (band on the npu path); Gemma2's softcap runs the torch path (HF's sdpa refuses it: eager)."""
    overrides = dict(use_sliding_window=True, sliding_window=6, max_window_layers=0) if model_type == "qwen2" else {}
    reference = "eager" if model_type == "gemma2" else "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).float()
    assert "sliding_attention" in model.config.layer_types
    for kind in ("left", "packed"):
        batch = _batch(kind)
        model.set_attn_implementation(reference)
        loss_ref, grads_ref = loss_and_grads(model, batch)
        model.set_attn_implementation(attention.ATTENTION_NAME)
        loss, grads = loss_and_grads(model, batch)
        torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
        assert_close_grads(grads_ref, grads)


def test_generate_left_padded_matches_sdpa(backend):
    """Prefill on the fused path, cached decoding steps on the torch path: the same greedy tokens and logits."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).float().eval()
    batch = padded_batch(batch=2, seq=11, left=True)
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    results = []
    for impl in ("sdpa", attention.ATTENTION_NAME):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            tokens = model.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=0)
            logits = model(**inputs).logits[batch["attention_mask"].bool()]
        results.append((tokens, logits))
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[1][1], results[0][1], atol=1e-5, rtol=1e-5)


def test_npu_keeps_padding_in_place_without_gathers(monkeypatch):
    """Rows padded on either side (or fully padded) stay where they are on the TND axis: the padding runs as
    sequences of its own (cut in PAD_PIECE pieces) that no real token sees, nothing is gathered or scattered, the
    real positions equal HF's SDPA (values and gradients) and the padded ones are zeros."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mindspeed_hf.ops import registry

    registry.set_backend("npu")
    monkeypatch.setattr(varlen, "PAD_PIECE", 5)
    padding = torch.zeros(B, S, dtype=torch.long)
    padding[0, 4:30] = 1  # both sides
    padding[1] = 1  # none
    case = padding, None, None, padding.bool(), B, S  # row 2: fully padded
    info = varlen.build_varlen_info(padding, "padding")
    assert info.indices is None and info.cu_seqlens == (
        4, 30, 35, 37, 74, 79, 84, 89, 94, 99, 104, 109, 111)
    qkv = _qkv()
    expected, expected_grads = _run("sdpa", sdpa_attention_forward, qkv, case)

    class Ops(TorchDispatchMode):
        seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    varlen.clear_cache()
    counts = _count_calls(monkeypatch)
    with Ops() as ops:
        out, grads = _run(attention.ATTENTION_NAME, attention.attention_forward, qkv, case)
    assert counts["layouts"] == ["TND"]
    assert not ops.seen & {"aten.index_select", "aten.index_copy", "aten.index_add", "aten.nonzero"}, ops.seen
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    full, _ = attention.attention_forward(_Attn(), *qkv, _mask(attention.ATTENTION_NAME, padding, None, None, B, S),
                                          scaling=SCALE)
    assert torch.count_nonzero(full.detach()[~padding.bool()]) == 0


def _count_calls(monkeypatch):
    npu = import_torch_npu()
    counts = {"op": 0, "build": [], "layouts": [], "ends": []}
    real_op, real_build = npu.npu_fusion_attention, varlen.build_varlen_info

    def op(*args, **kwargs):
        counts["op"] += 1
        counts["layouts"].append(args[4])
        counts["ends"].append(tuple(kwargs.get("actual_seq_qlen") or ()))
        return real_op(*args, **kwargs)

    def build(source, kind):
        counts["build"].append(kind)
        return real_build(source, kind)

    monkeypatch.setattr(npu, "npu_fusion_attention", op)
    monkeypatch.setattr(varlen, "build_varlen_info", build)
    return counts


def test_npu_builds_cumulative_lengths_once_per_forward(monkeypatch):
    from mindspeed_hf.ops import registry

    registry.set_backend("npu")
    counts = _count_calls(monkeypatch)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="mindspeed").float()
    assert model.config.num_hidden_layers == 2
    model(**_batch("left")).loss.backward()
    assert counts["op"] == 2 and counts["layouts"] == ["TND", "TND"] and counts["build"] == ["padding"]

    counts.update(op=0, build=[], layouts=[])
    model(**_batch("packed"))
    assert counts["op"] == 2 and counts["build"] == ["sequence_ids"]

    counts.update(op=0, build=[], layouts=[])
    batch = {k: v for k, v in padded_batch().items() if k != "attention_mask"}
    model(**batch, use_cache=False)
    # No padding: no host sync at all, except where transformers (4.57) describes every batch without a mask as
    # packed; one read tells it is not (5.x does that same read itself).
    syncs = ["sequence_ids"] if unpacked_batches_get_sequence_ids() else []
    assert counts["layouts"] == ["BSND", "BSND"] and counts["build"] == syncs


def test_npu_collator_batch_uses_cu_seq_lens(monkeypatch):
    """DataCollatorWithFlattening's cu_seq_lens_q give the boundaries; results equal HF's sdpa on position_ids."""
    from mindspeed_hf.ops import registry

    features = [{"input_ids": list(range(1 + i, 6 + 3 * i))} for i in range(3)]
    batch = dict(DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features), use_cache=False)
    assert "cu_seq_lens_q" in batch
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3"), attn_implementation="sdpa").float()
    loss_ref, grads_ref = loss_and_grads(model, batch)
    registry.set_backend("npu")
    counts = _count_calls(monkeypatch)
    model.set_attn_implementation(attention.ATTENTION_NAME)
    loss, grads = loss_and_grads(model, batch)
    # q and k boundaries are separate tensors: each read once per forward, then reused by every layer
    assert counts["build"] == ["cu_seqlens"] * (1 if batch["cu_seq_lens_k"] is batch["cu_seq_lens_q"] else 2)
    assert counts["layouts"] == ["TND", "TND"]
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
    assert_close_grads(grads_ref, grads)


# Three documents (5, 7, 9 tokens) and 3 padding tokens, as packing frameworks hand them over.
_DOCS = (5, 7, 9)


def _documents_batch() -> tuple[dict, dict]:
    """(the documents packed in one row, with position ids restarting and the collator's cu_seq_lens; the same
    documents right-padded, one per row), labels summed over one divisor so the losses compare."""
    gen = torch.Generator().manual_seed(3)
    docs = [torch.randint(1, 100, (n,), generator=gen) for n in _DOCS]
    flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")(
        [{"input_ids": d.tolist()} for d in docs])
    items = sum(n - 1 for n in _DOCS)
    padded = {"input_ids": torch.zeros(len(docs), max(_DOCS), dtype=torch.long),
              "attention_mask": torch.zeros(len(docs), max(_DOCS), dtype=torch.long),
              "labels": torch.full((len(docs), max(_DOCS)), -100)}
    for row, doc in enumerate(docs):
        padded["input_ids"][row, :len(doc)] = padded["labels"][row, :len(doc)] = doc
        padded["attention_mask"][row, :len(doc)] = 1
    return {**flat, "num_items_in_batch": items, "use_cache": False}, {**padded, "num_items_in_batch": items}


def _block_diagonal(lengths, pad: int, dtype) -> torch.Tensor:
    """LLaMA-Factory's neat_packing mask: [1, 1, S, S], causal inside each document, padding queries see nothing;
    additive float (0 / the dtype's lowest) or bool (True = attend)."""
    index = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)] + [torch.zeros(pad, dtype=torch.long)])
    seq = index.numel()
    allowed = (index[:, None] == index[None, :]) & (index[None, :] != 0) & torch.ones(seq, seq).tril().bool()
    if dtype == torch.bool:
        return allowed[None, None]
    return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]


def _model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("qwen3"), attn_implementation="sdpa").float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_npu_block_diagonal_mask_runs_packed(dtype, monkeypatch):
    """A block-diagonal causal 4-D mask (LLaMA-Factory's neat_packing) runs as packed documents (TND, one sequence
    per document, the padding in pieces of its own), equal to HF's sdpa on the same mask and to the documents
    padded; one read of the mask per forward."""
    from mindspeed_hf.ops import registry

    packed, padded = _documents_batch()
    pad = 3
    batch = {"input_ids": torch.nn.functional.pad(packed["input_ids"], (0, pad)),
             "labels": torch.nn.functional.pad(packed["labels"], (0, pad), value=-100),
             "position_ids": torch.nn.functional.pad(packed["position_ids"], (0, pad)),
             "attention_mask": _block_diagonal(_DOCS, pad, dtype), "use_cache": False,
             "num_items_in_batch": packed["num_items_in_batch"]}
    model = _model()
    loss_ref, grads_ref = loss_and_grads(model, batch)
    loss_padded, _ = loss_and_grads(model, padded)
    torch.testing.assert_close(loss_ref, loss_padded, atol=1e-5, rtol=1e-5)
    registry.set_backend("npu")
    counts = _count_calls(monkeypatch)
    model.set_attn_implementation(attention.ATTENTION_NAME)
    loss, grads = loss_and_grads(model, batch)
    assert counts["layouts"] == ["TND", "TND"] and counts["build"] == ["block_causal"]
    assert counts["ends"][0] == (5, 12, 21, 24)
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
    assert_close_grads(grads_ref, grads)


def test_block_causal_recognised_exactly():
    """Only an exactly block-diagonal causal pattern reads as documents; a hole, a window, a bias, a non-causal
    block or a query seeing padding keep the masked path."""
    mask = _block_diagonal((3, 4), 2, torch.float32)
    assert varlen.block_causal_info(mask).cu_seqlens == (3, 7, 9)
    assert varlen.block_causal_info(mask == 0).cu_seqlens == (3, 7, 9)
    one = varlen.block_causal_info(_block_diagonal((9,), 0, torch.bool))
    assert one.cu_seqlens == (9,) and one.is_dense(1)
    allowed = mask[0, 0] == 0
    others = {"hole": allowed.clone(), "window": allowed & ~torch.ones(9, 9).tril(-3).bool(),
              "full block": allowed.clone(), "sees padding": allowed.clone()}
    others["hole"][5, 4] = False
    others["full block"][0, 1] = True
    others["sees padding"][8, 7] = True
    for name, pattern in others.items():
        assert varlen.block_causal_info(pattern[None, None]) is None, name
    biased = mask.clone()
    biased[0, 0, 4, 3] = -2.0  # an additive bias, not a boundary
    assert varlen.block_causal_info(biased) is None


def test_npu_other_4d_masks_fall_back_saying_why(caplog, monkeypatch):
    from mindspeed_hf.ops import registry

    monkeypatch.setattr(attention, "_warned", set())  # said once per process: an earlier test may have said it

    registry.set_backend("npu")
    qkv = _qkv(1, 9)
    mask = _block_diagonal((3, 6), 0, torch.bool)
    mask[0, 0, 8, 4] = False  # a hole: not documents
    expected, _ = sdpa_attention_forward(_Attn(), *qkv, mask, scaling=SCALE)
    with caplog.at_level(logging.WARNING, logger="mindspeed_hf"):
        out, _ = attention.attention_forward(_Attn(), *qkv, mask, scaling=SCALE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert "not block-diagonal causal" in caplog.text and "cached decoding" not in caplog.text


def test_cu_seq_lens_alone_keep_documents_apart(backend, monkeypatch):
    """A packed row told apart only by the collator's cu_seq_lens (no position ids, as flash attention reads it):
    each document attends to itself on every backend (TND on npu), equal to the documents padded; HF's sdpa,
    which reads no cu_seq_lens, attends across them (the control)."""
    packed, padded = _documents_batch()
    batch = {k: v for k, v in packed.items() if k != "position_ids"}
    model = _model()
    loss_ref, grads_ref = loss_and_grads(model, padded)
    assert (loss_and_grads(model, batch)[0] - loss_ref).abs() > 1e-3  # HF's sdpa crosses the documents
    counts = _count_calls(monkeypatch)
    model.set_attn_implementation(attention.ATTENTION_NAME)
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
    assert_close_grads(grads_ref, grads)
    if backend == "npu":
        assert counts["layouts"] == ["TND", "TND"] and counts["ends"][0] == (5, 12, 21)


# ------------------------------------------------------------------------------------------------ registration


def test_register_then_unregister_restores_interfaces():
    attention.unregister_attention()  # undo the fixture: start from HF's own tables
    before = (dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping))
    attention.register_attention()
    attention.register_attention()  # idempotent
    assert AttentionInterface._global_mapping["mindspeed"] is attention.attention_forward
    assert AttentionMaskInterface._global_mapping["mindspeed"] is attention.mindspeed_mask
    attention.unregister_attention()
    attention.unregister_attention()
    assert (dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping)) == before

    # Someone else's "mindspeed" entries come back exactly.
    def theirs(*args, **kwargs):
        return None

    AttentionInterface.register("mindspeed", theirs)
    AttentionMaskInterface.register("mindspeed", theirs)
    try:
        attention.register_attention()
        assert AttentionInterface._global_mapping["mindspeed"] is attention.attention_forward
        attention.unregister_attention()
        assert AttentionInterface._global_mapping["mindspeed"] is theirs
        assert AttentionMaskInterface._global_mapping["mindspeed"] is theirs
    finally:
        del AttentionInterface._global_mapping["mindspeed"], AttentionMaskInterface._global_mapping["mindspeed"]
    assert (dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping)) == before


def test_attn_implementation_not_saved_in_config(tmp_path):
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3"), attn_implementation="mindspeed")
    model.config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "mindspeed" not in json.dumps(saved)


def test_npu_under_inference_mode(backend):
    """Inference tensors carry no version counter, and nothing cached under inference mode may leak into a later
    training step (the compressed causal mask is cached per device)."""
    attention._compressed_masks.clear()
    case = _case("left")
    padding, position_ids, window, valid, batch, seq = case
    q, k, v = (t.detach() for t in _qkv(batch, seq))
    expected, _ = sdpa_attention_forward(_Attn(), q, k, v, _mask("sdpa", padding, None, None, batch, seq),
                                         scaling=SCALE)
    with torch.inference_mode():
        mask = _mask(attention.ATTENTION_NAME, padding.clone(), None, None, batch, seq)
        out, _ = attention.attention_forward(_Attn(), q, k, v, mask, scaling=SCALE)
    torch.testing.assert_close(out[valid], expected[valid], atol=1e-5, rtol=1e-5)
    qkv = _qkv(batch, seq)
    _run(attention.ATTENTION_NAME, attention.attention_forward, qkv, _case("causal"))  # trains afterwards

