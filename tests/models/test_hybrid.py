"""Hybrid linear-attention families (Qwen3-Next, Qwen3.5, Qwen3.5-MoE text models): Gated DeltaNet layers among
gated full-attention layers. Against the unpatched model (fp32, 1e-5, loss and every gradient) on the torch reference
and the NPU path (stand-in torch_npu): right- and left-padded batches against HF's same batch, and a packed row
against HF on the same documents as separate rows - HF's own packed forward carries the linear layers' state across
documents, so it is not the reference (measured below). Also: what report() says ran, the NPU ops, generation,
an explicit attention request, disable(), the context-parallel refusal, and the flash-linear-attention call."""

import sys
import types

import pytest
import torch
from tiny_models import HYBRID_CONFIGS, VOCAB, assert_close_grads, installed, loss_and_grads, modeling_of, tiny_model

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.ops import linear_attention as ops
from mindspeed_hf.ops.varlen import length_groups
from mindspeed_hf.patches import FAMILIES, experts

INSTALLED = [name for name in sorted(HYBRID_CONFIGS) if modeling_of(name)]  # 4.57: qwen3_next only
HYBRIDS = installed(sorted(HYBRID_CONFIGS))
LENGTHS = (70, 40, 25)  # the longest spans two of HF's 64-token chunks


def test_every_hybrid_family_has_a_test_config():
    text = {name for name, family in FAMILIES.items() if family.linear_attention and family.causal_lm}
    assert set(HYBRID_CONFIGS) == text  # the vision-language ones: tests/models/test_vlm.py


def _batches() -> dict[str, dict]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (1, sum(LENGTHS)), generator=gen)
    starts = torch.tensor([0, *LENGTHS[:-1]]).cumsum(0)
    labels = ids.clone()
    labels[0, starts] = -100  # the first token of a document is not predicted from the one before
    packed = {"input_ids": ids, "position_ids": torch.cat([torch.arange(n) for n in LENGTHS])[None], "labels": labels}
    rows = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    mask = torch.zeros_like(rows)
    for row, (start, n) in enumerate(zip(starts.tolist(), LENGTHS)):
        rows[row, :n], mask[row, :n] = ids[0, start:start + n], 1
    right = {"input_ids": rows, "attention_mask": mask, "labels": rows.masked_fill(mask == 0, -100), "use_cache": False}
    left = {name: value.flip(1) if isinstance(value, torch.Tensor) else value for name, value in right.items()}
    return {"packed": packed, "right_padded": right, "left_padded": left}


def _layers(model, kind: str) -> int:
    return model.config.layer_types.count(kind)


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_hybrid_parity(model_type, backend, monkeypatch):
    model = tiny_model(model_type)
    batches = _batches()
    expected = {name: loss_and_grads(model, batch) for name, batch in batches.items() if name != "packed"}
    expected["packed"] = expected["right_padded"]  # the documents as separate rows
    calls: dict[str, int] = {}
    if backend == "npu":
        import torch_npu

        def counting(name, original):
            def counted(*args, **kwargs):
                calls[name] = calls.get(name, 0) + 1
                return original(*args, **kwargs)
            return counted

        for name in ("npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu"):
            monkeypatch.setattr(torch_npu, name, counting(name, getattr(torch_npu, name)))

    mindspeed_hf.enable(config_from_dict({"backend": backend}))
    report = mindspeed_hf.apply_to_model(model)
    linear, full = _layers(model, "linear_attention"), _layers(model, "full_attention")
    kernels = report["kernels"]
    assert kernels["linear_attention"] == linear and kernels["attention"] == full and kernels["rope"] == full
    # every decoder norm, q/k norms of the full layers, the final norm and the linear layers' gated norms
    assert kernels["rms_norm"] == 2 * (linear + full) + 2 * full + 1 + linear
    assert report["attention_implementation"] == "mindspeed" and kernels["fused_linear_cross_entropy"] == 1
    assert report["implementations"]["linear_attention"] == "torch:chunked (transformers)"  # no flash-linear-attention
    for name, batch in batches.items():
        loss, grads = loss_and_grads(model, batch)
        torch.testing.assert_close(loss, expected[name][0], atol=1e-5, rtol=1e-5, msg=f"{model_type} {name} loss")
        assert_close_grads(expected[name][1], grads)
    ran = mindspeed_hf.report(model)["ran"]
    # a packed row runs its documents in groups of similar length: (70, 40) and (25) here, one rule call each; the
    # model was built before enable(): on transformers < 5.20 its layers bound HF's rule then, rebound by apply
    groups = len(length_groups(list(LENGTHS)))
    assert groups == 2 and ran["linear_attention"] == (len(batches) - 1 + groups) * linear
    assert ran["attention"] == len(batches) * full
    if backend == "npu":
        assert calls["npu_fusion_attention"] == len(batches) * full, calls
        assert calls["npu_rms_norm"] >= len(batches) * kernels["rms_norm"], calls
        assert calls["npu_rotary_mul"] > 0 and calls["npu_swiglu"] > 0, calls


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_hf_packed_forward_is_not_the_reference(model_type):
    """Why the packed reference is the documents as rows: HF's packed forward differs from them (its linear layers
    run across the documents), ours does not."""
    model = tiny_model(model_type)
    batches = _batches()
    with torch.no_grad():
        rows, hf_packed = (model(**batches[name]).loss for name in ("right_padded", "packed"))
        assert (hf_packed - rows).abs() > 1e-5
        mindspeed_hf.enable(config_from_dict({"backend": "torch"}))
        mindspeed_hf.apply_to_model(model)
        torch.testing.assert_close(model(**batches["packed"]).loss, rows, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_generation_and_explicit_attention_and_disable(model_type):
    model = tiny_model(model_type).eval()
    prompt = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0  # left-padded second row
    args = dict(input_ids=prompt, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = model.generate(**args)
    module = sys.modules[type(model).__module__]
    rule = module.torch_chunk_gated_delta_rule if hasattr(module, "torch_chunk_gated_delta_rule") else None

    mindspeed_hf.enable(config_from_dict({"backend": "torch"}))
    mindspeed_hf.apply_to_model(model)
    assert torch.equal(model.generate(**args), expected)
    eager = tiny_model(model_type, attn_implementation="eager")
    assert mindspeed_hf.apply_to_model(eager)["attention_implementation"] == "eager"  # an explicit request is kept

    mindspeed_hf.disable()
    assert model.config._attn_implementation == "sdpa"
    assert rule is None or module.torch_chunk_gated_delta_rule is rule
    # no layer keeps our rule (on < 5.20 each layer binds the rule when built; apply_to_model rebinds it)
    assert not any(getattr(vars(m).get("chunk_gated_delta_rule"), "_mindspeed_op", None) for m in model.modules())
    assert torch.equal(model.generate(**args), expected)


def test_context_parallel_refuses_hybrid_models_in_one_line():
    from mindspeed_hf.parallel.context.model import check_context_parallel

    with pytest.raises(ValueError, match=rf"parallel.cp: {INSTALLED[0]} has Gated DeltaNet .* valid choices: "
                                         r"parallel.cp=1") as error:
        check_context_parallel(tiny_model(INSTALLED[0]), ulysses=1)
    assert "\n" not in str(error.value)


def test_fla_call_contract(monkeypatch):
    """On CUDA / NPU with flash-linear-attention installed the rule is its chunk_gated_delta_rule: called with
    transformers' arguments, grouped key/query heads repeated up to the value heads. A stand-in fla (HF's torch rule
    behind fla's signature) checks the call; the real kernels need a GPU or an NPU, which these tests do not have."""
    module = modeling_of(INSTALLED[0])
    reference = getattr(module, "torch_chunk_gated_delta_rule", None)
    if reference is None:
        pytest.skip("this release has no module-level torch_chunk_gated_delta_rule")
    seen = {}

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False):
        seen.update(heads=(q.shape[2], k.shape[2], v.shape[2]), cu_seqlens=cu_seqlens)
        return reference(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    fla = types.ModuleType("fla.ops.gated_delta_rule")
    fla.chunk_gated_delta_rule = chunk_gated_delta_rule
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.ops", types.ModuleType("fla.ops"))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fla)
    ops.fla_available.cache_clear()
    try:
        gen = torch.Generator().manual_seed(5)
        q, k = (torch.randn(2, 70, 2, 16, generator=gen) for _ in range(2))
        v = torch.randn(2, 70, 4, 16, generator=gen)
        g, beta = -torch.rand(2, 70, 4, generator=gen), torch.rand(2, 70, 4, generator=gen)
        # (transformers < 5.20's torch rule wants the heads repeated by its caller; later ones repeat them too)
        want, _ = reference(*(x.repeat_interleave(2, dim=2) for x in (q, k)), v, g=g, beta=beta,
                            use_qk_l2norm_in_kernel=True)
        got, _ = ops.chunk_rule_fla(reference, q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=None)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert seen["heads"] == (4, 4, 4)
        assert ops.fla_available()
    finally:
        ops.fla_available.cache_clear()


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_lora_on_the_linear_attention_and_the_experts(model_type, backend):
    """PEFT LoRA on every projection (the Gated DeltaNet's in/out projections too) and, on the MoE ones, on the
    fused expert weights (target_parameters): loss and adapter gradients equal the unpatched PEFT model's."""
    from peft import LoraConfig, get_peft_model

    fused = "num_experts" in HYBRID_CONFIGS[model_type] and experts.available()  # 3-D experts: transformers >= 5.10
    extra = {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]} if fused else {}
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False,
                      **extra)
    batches = _batches()
    expected = {name: loss_and_grads(get_peft_model(tiny_model(model_type), lora), batch)
                for name, batch in batches.items() if name != "packed"}
    expected["packed"] = expected["right_padded"]
    model = get_peft_model(tiny_model(model_type), lora)
    assert any("linear_attn.in_proj" in name and "lora_A" in name for name, _ in model.named_parameters())
    mindspeed_hf.enable(config_from_dict({"backend": backend}))
    assert mindspeed_hf.apply_to_model(model)["kernels"]["linear_attention"] == _layers(model, "linear_attention")
    for name, batch in batches.items():
        loss, grads = loss_and_grads(model, batch)
        assert grads and all("lora_" in n for n in grads)
        torch.testing.assert_close(loss, expected[name][0], atol=1e-5, rtol=1e-5, msg=name)
        assert_close_grads(expected[name][1], grads)


MEMORY = {"full": {"recompute": "full"}, "selective": {"recompute": "selective"},
          "offload+selective": {"recompute": "selective", "offload_activations": True, "offload_min_bytes": 0}}


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_recompute_and_offload_are_bitwise_equal(model_type):
    """memory.recompute (full, selective) and activation offload on the hybrid layers: loss and every gradient
    bitwise equal to the same accelerated model without them, padded and packed."""
    from test_selective_recompute import _assert_bitwise, _loss_and_grads

    from mindspeed_hf.parallel.parallelize import parallelize

    def prepared(memory: dict | None):
        model = tiny_model(model_type).train()
        config = config_from_dict({"memory": memory or {}})
        mindspeed_hf.enable()
        mindspeed_hf.apply_to_model(model, config)
        return parallelize(model, None, config)

    for name, batch in _batches().items():
        if name == "left_padded":
            continue
        expected = _loss_and_grads(prepared(None), batch)
        for mode, memory in MEMORY.items():
            got = _loss_and_grads(prepared(memory), batch)
            assert got[1], mode
            _assert_bitwise(expected, got)


def test_documents_are_grouped_with_little_padding_and_laid_back_exactly():
    """ops/varlen.document_layout: every document in exactly one group, no group more than a quarter padding, and
    the packed tokens back in place through the rows (values and gradients)."""
    from mindspeed_hf.ops import varlen

    gen = torch.Generator().manual_seed(6)
    for _ in range(20):
        lengths = torch.randint(1, 90, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
        groups = length_groups(lengths)
        assert sorted(d for g in groups for d in g) == list(range(len(lengths)))
        for group in groups:
            assert sum(lengths[d] for d in group) >= 0.75 * len(group) * max(lengths[d] for d in group)
        ends = torch.tensor(lengths).cumsum(0).tolist()
        layout = varlen.document_layout(varlen.VarlenInfo(None, tuple(ends), True, ends[-1]), "cpu")
        x = torch.randn(1, ends[-1], 3, generator=gen, requires_grad=True)
        rows = [g.to_rows(x.reshape(-1, 3)) for g in layout.groups]
        assert all(int(g.mask.sum()) == len(g.tokens) for g in layout.groups)
        back = layout.join([r * 2 for r in rows], 1)
        torch.testing.assert_close(back, 2 * x, atol=0, rtol=0)
        back.sum().backward()
        torch.testing.assert_close(x.grad, torch.full_like(x, 2.0), atol=0, rtol=0)
