"""Every supported family: a tiny model's loss and all gradients with mindspeed_hf equal the unpatched model
(fp32, 1e-5) for padded and packed batches, on the torch reference and on the NPU path (stand-in torch_npu);
disable() restores the original objects and the original numbers."""

import pytest
import torch
import transformers
from tiny_models import FAMILY_CONFIGS, assert_close_grads, loss_and_grads, packed_batch, padded_batch, tiny_model

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.patches import FAMILIES
from mindspeed_hf.patches.families import ModelFamily
from mindspeed_hf.releases import compat
from mindspeed_hf.releases.compat import checkpointing_cell, sdpa_replaceable

# Text decoders (XForCausalLM heads); vision-language and third-party families have their own tests
# (tests/models/test_vlm.py, the Qwen3-TTS example's).
# Hybrid linear-attention families: tests/models/test_hybrid.py (their packed reference is not HF's packed forward).
TEXT_FAMILIES = {name: family for name, family in FAMILIES.items() if family.causal_lm and not family.linear_attention}
# Families whose decoder layers run the residual add fused into the norm after it (add_rms_norm). Phi-3 (dropout on
# the residual branch) and GPT-OSS (its own RMSNorm) keep HF's layer forward; so do, on transformers 4.x, the layers
# whose body differs there (MoE outputs unpacked from tuples, tuples returned, Mixtral's `block_sparse_moe`).
ADD_NORM_FAMILIES = {name for name, family in TEXT_FAMILIES.items() if family.decoder_layer} - (
    set() if int(transformers.__version__.split(".")[0]) >= 5 else {
        "qwen2_moe", "qwen3_moe", "ernie4_5_moe", "mixtral", "olmoe", "gemma2", "gemma3_text"})
BATCHES = {"right_padded": padded_batch, "left_padded": lambda: padded_batch(left=True), "packed": packed_batch}


def _snapshot(family: ModelFamily) -> dict:
    import importlib

    module = importlib.import_module(family.modeling_module)
    names = {*family.rms_norm, *family.swiglu_mlp, *family.packed_swiglu_mlp, *family.causal_lm, family.pretrained,
             *([family.decoder_layer] if family.decoder_layer else [])}
    snap = {("module", "apply_rotary_pos_emb"): module.apply_rotary_pos_emb}
    if family.decoder_layer:  # transformers >= 5.24 wraps the layer forward: what the wrapper calls is patched
        cell = checkpointing_cell(getattr(module, family.decoder_layer).forward)
        snap[("cell", family.decoder_layer)] = cell.cell_contents if cell is not None else None
    for name in names:
        # Everything in the class dicts, except a cache transformers itself fills in on set_attn_implementation.
        snap.update({(name, a): v for a, v in vars(getattr(module, name)).items() if not a.endswith("_cached_value")})
    return snap


def test_every_family_has_a_test_config():
    assert set(TEXT_FAMILIES) == set(FAMILY_CONFIGS)


@pytest.mark.parametrize("model_type", sorted(TEXT_FAMILIES))
def test_family_parity(model_type, backend):
    model = tiny_model(model_type)
    expected = {name: loss_and_grads(model, make()) for name, make in BATCHES.items()}
    originals = _snapshot(FAMILIES[model_type])
    # Our attention takes the place of HF's sdpa where it gives the same results (Gemma2 in 5.x stays eager: no sdpa)
    replaced = model.config._attn_implementation == "sdpa" and sdpa_replaceable(model)

    mindspeed_hf.enable(config_from_dict({"backend": backend}))
    report = mindspeed_hf.apply_to_model(model)
    kernels = report["kernels"]
    assert (kernels["rms_norm"] > 0) == bool(FAMILIES[model_type].rms_norm)
    assert kernels["fused_linear_cross_entropy"] == 1
    assert kernels["rope"] == (model.config.num_hidden_layers if FAMILIES[model_type].rope else 0)
    assert kernels["attention"] == (model.config.num_hidden_layers if replaced else 0)
    mlp_classes = {*FAMILIES[model_type].swiglu_mlp, *FAMILIES[model_type].packed_swiglu_mlp}
    assert kernels["swiglu"] == sum(type(m).__name__ in mlp_classes for m in model.modules())
    assert report["backend"] == backend
    for name, make in BATCHES.items():
        loss, grads = loss_and_grads(model, make())
        torch.testing.assert_close(loss, expected[name][0], atol=1e-5, rtol=1e-5, msg=f"{model_type} {name} loss")
        assert_close_grads(expected[name][1], grads)
    # The fused add+norm really ran in every layer of the runs above (so the parity covers its forward and backward)
    # on the npu path; the torch backend has no add+norm kernel: HF's layer forward ran there (counted: none)
    after = mindspeed_hf.report(model)
    fused = model_type in ADD_NORM_FAMILIES and backend == "npu"
    assert after["add_rms_norm_layers"] == (model.config.num_hidden_layers if fused else 0)
    assert after["ran"]["add_rms_norm"] == (len(BATCHES) * model.config.num_hidden_layers if fused else 0)
    assert after["implementations"]["add_rms_norm"] == ("torch" if backend == "torch" else "npu:npu_add_rms_norm")

    mindspeed_hf.disable()
    assert _snapshot(FAMILIES[model_type]) == originals
    assert mindspeed_hf.report(model)["kernels"] == dict.fromkeys(report["kernels"], 0)
    loss, _ = loss_and_grads(model, padded_batch())
    torch.testing.assert_close(loss, expected["right_padded"][0], atol=0, rtol=0)


def test_add_norm_families():
    """The families whose decoder layer has HF's add-then-norm shape on this release fuse it, and only those."""
    assert {n for n, f in TEXT_FAMILIES.items() if f.decoder_layer} == set(TEXT_FAMILIES) - {"phi3", "gpt_oss"}
    mindspeed_hf.enable()
    from mindspeed_hf.patches import apply

    text_layers = {TEXT_FAMILIES[n].decoder_layer for n in TEXT_FAMILIES}
    assert {cls.__name__ for cls in apply._fused_layers} & text_layers == {
        TEXT_FAMILIES[n].decoder_layer for n in ADD_NORM_FAMILIES}


def test_torch_backend_runs_hf_layer_forward_with_our_norms():
    """On the torch backend (no add+norm kernel) the fused layer forward hands over to HF's layer forward at once:
    HF's numbers, nothing counted as add_rms_norm, every norm (the post-attention ones too) on the rms_norm kernel."""
    model = tiny_model("llama")
    batch = padded_batch()
    expected = loss_and_grads(model, batch)
    mindspeed_hf.enable(config_from_dict({"backend": "torch"}))
    mindspeed_hf.apply_to_model(model)
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)
    report = mindspeed_hf.report(model)
    assert report["ran"]["add_rms_norm"] == 0 and report["add_rms_norm_layers"] == 0
    assert report["ran"]["rms_norm"] == 2 * model.config.num_hidden_layers + 1


def test_add_norm_falls_back_where_the_norm_is_not_plainly_ours():
    """A hook on the norm (it must fire), or the rms_norm kernel switched off: HF's layer forward, same numbers
    (on the npu path, where the add+norm fuses)."""
    model = tiny_model("llama")
    batch = padded_batch()
    expected = loss_and_grads(model, batch)
    seen = []
    model.model.layers[0].post_attention_layernorm.register_forward_hook(lambda *a: seen.append(1))
    mindspeed_hf.enable(config_from_dict({"backend": "npu"}))
    mindspeed_hf.apply_to_model(model)
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)
    assert seen and mindspeed_hf.report(model)["ran"]["add_rms_norm"] == model.config.num_hidden_layers - 1
    mindspeed_hf.apply_to_model(model, config_from_dict({"backend": "npu", "kernels": {"rms_norm": False}}))
    assert mindspeed_hf.report(model)["add_rms_norm_layers"] == 0


def _checkpointed_then_accelerated(model_type: str, backend: str = "auto"):
    """(the tiny model with HF's gradient checkpointing on, a padded batch, its plain loss and gradients), the model
    then accelerated."""
    model = tiny_model(model_type).train()
    model.gradient_checkpointing_enable()
    batch = padded_batch()
    expected = loss_and_grads(model, batch)
    mindspeed_hf.enable(config_from_dict({"backend": backend}))
    mindspeed_hf.apply_to_model(model)
    return model, batch, expected


def _scope_hooked(root: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules under `root` (itself included) that carry our scope hooks."""
    return [m for m in root.modules() if any(getattr(h, "_mindspeed_scope", False)
                                             for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values()))]


def test_add_norm_keeps_gradient_checkpointing():
    """With HF's gradient checkpointing on, the fused layers give the plain model's numbers, and transformers' own
    checkpointing wrapper of the layer forward (5.24+) stays in place: only what it calls is ours."""
    from transformers.models.llama import modeling_llama

    before = modeling_llama.LlamaDecoderLayer.forward
    model, batch, expected = _checkpointed_then_accelerated("llama", "npu")  # the backend that fuses the add+norm
    assert (modeling_llama.LlamaDecoderLayer.forward is before) == (checkpointing_cell(before) is not None)
    # a fused layer enters its model's scope itself, also where it is rerun: no hooks on it or its children
    assert _scope_hooked(model.model.layers) == [] and _scope_hooked(model) != []
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)
    # once in the forward, once more where checkpointing reran each layer in backward (outside every hook: counted
    # into the model's report by the layer's own scope entry)
    assert mindspeed_hf.report(model)["ran"]["add_rms_norm"] == 2 * model.config.num_hidden_layers


def test_unfused_layers_enter_their_scope_under_gradient_checkpointing():
    """A decoder layer whose forward is not one of the fused shapes (Phi-3) still enters its model's scope itself
    (HF's forward inside): no scope hooks on it or its parts, the plain model's numbers, and the norms of the layers
    that checkpointing reruns in backward counted into the model's report under the model's own config (one model
    with rms_norm off beside the process config with it on); disable() puts HF's forward back."""
    from transformers.models.phi3 import modeling_phi3

    before = modeling_phi3.Phi3DecoderLayer.forward
    inner_before = compat.layer_function(modeling_phi3.Phi3DecoderLayer)
    model, batch, expected = _checkpointed_then_accelerated("phi3")
    assert getattr(compat.layer_function(modeling_phi3.Phi3DecoderLayer), "_mindspeed_enters_scope", False)
    assert _scope_hooked(model.model.layers) == []
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)
    layers = model.config.num_hidden_layers
    # two norms per layer, forward and the rerun in backward, plus the final norm once
    assert mindspeed_hf.report(model)["ran"]["rms_norm"] == 2 * 2 * layers + 1
    mindspeed_hf.apply_to_model(model, config_from_dict({"kernels": {"rms_norm": False}}))
    loss, grads = loss_and_grads(model, batch)
    assert mindspeed_hf.report(model)["ran"]["rms_norm"] == 2 * 2 * layers + 1  # none more: off for this model
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    mindspeed_hf.disable()
    assert modeling_phi3.Phi3DecoderLayer.forward is before
    assert compat.layer_function(modeling_phi3.Phi3DecoderLayer) is inner_before


def test_models_built_while_enabled_use_kernels_and_survive_disable():
    mindspeed_hf.enable()
    model = tiny_model("qwen3")
    assert model.config._attn_implementation == "mindspeed"
    counts = mindspeed_hf.report(model)["kernels"]
    assert counts == {"rms_norm": 9, "rope": 2, "swiglu": 2, "attention": 2, "fused_linear_cross_entropy": 1,
                      "experts": 0, "linear_attention": 0}
    mindspeed_hf.disable()
    assert model.config._attn_implementation == "sdpa"
    model(**padded_batch())  # still runs, unaccelerated


@pytest.mark.parametrize("model_type", sorted(TEXT_FAMILIES))
def test_family_built_while_enabled_matches_hf(model_type):
    """A model built after enable() (what `import mindspeed_hf` does) builds, gets the kernels, and gives the plain
    model's loss and gradients; its attention is ours exactly where ours can stand in for its sdpa."""
    batch = padded_batch(left=True)
    plain = tiny_model(model_type)
    expected = loss_and_grads(plain, batch)
    mindspeed_hf.enable()
    model = tiny_model(model_type)
    kernels = mindspeed_hf.report(model)["kernels"]
    assert (kernels["rms_norm"] > 0) == bool(FAMILIES[model_type].rms_norm)
    assert kernels["fused_linear_cross_entropy"] == 1
    replaced = plain.config._attn_implementation == "sdpa" and sdpa_replaceable(plain)
    assert model.config._attn_implementation == ("mindspeed" if replaced else plain.config._attn_implementation)
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)


def test_enable_is_idempotent_and_disable_restores_exactly():
    from transformers.models.llama import modeling_llama

    before = (modeling_llama.LlamaRMSNorm.forward, modeling_llama.apply_rotary_pos_emb)
    mindspeed_hf.enable()
    patched = (modeling_llama.LlamaRMSNorm.forward, modeling_llama.apply_rotary_pos_emb)
    mindspeed_hf.enable()
    assert (modeling_llama.LlamaRMSNorm.forward, modeling_llama.apply_rotary_pos_emb) == patched != before
    mindspeed_hf.disable()
    mindspeed_hf.disable()
    assert (modeling_llama.LlamaRMSNorm.forward, modeling_llama.apply_rotary_pos_emb) == before
    assert "get_correct_attn_implementation" not in vars(modeling_llama.LlamaPreTrainedModel)


def test_kernels_can_be_switched_off_one_by_one():
    mindspeed_hf.enable(config_from_dict({"kernels": {"swiglu": False, "attention": False}}))
    model = tiny_model("llama")
    counts = mindspeed_hf.report(model)["kernels"]
    assert counts["swiglu"] == 0 and counts["attention"] == 0 and counts["rms_norm"] == 5


def test_unsupported_model_runs_unaccelerated_with_one_warning(caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with caplog.at_level("WARNING", logger="mindspeed_hf"):
        first = mindspeed_hf.apply_to_model(model)
        mindspeed_hf.apply_to_model(model)
    assert sum("not supported" in r.message for r in caplog.records) == 1
    assert sum(first["kernels"].values()) == 0


def test_non_silu_activation_keeps_hf_mlp():
    model = tiny_model("llama", hidden_act="gelu")
    batch = padded_batch()
    expected = loss_and_grads(model, batch)
    mindspeed_hf.enable()
    mindspeed_hf.apply_to_model(model)
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)
