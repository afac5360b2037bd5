"""The Omni talkers (Qwen2.5-Omni's; Qwen3-Omni's MoE one and its code predictor): fine-tuning on codec labels.

Every reference is the unpatched model (built and run before enable(), as tests/models/test_omni.py does): the loss
must equal F.cross_entropy on HF's own codec_head logits with the one-shift alignment (logits at t against the
codec id at t + 1) within 1e-5 and every gradient must be within 1e-4 relative, on the torch and npu (stand-in)
backends; the code predictor's head j must be scored on codebook j + 1, HF's own head j logits (HF's forward picks
head j for a j + 2 position input); no-labels forwards and greedy generation equal HF's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import installed
from tiny_talker import (
    CODEC_BOS,
    CODEC_EOS,
    CODEC_MASK,
    CODEC_PAD,
    TALKER_TYPES,
    THINKER_WIDTH,
    code_predictor_batch,
    qwen3_talker_batch,
    talker_batch,
    tiny_talker,
)

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.patches import experts
from mindspeed_hf.patches.causal_lm import SkippedLogits
from mindspeed_hf.patches.lazy_logits import DeferredLogits

TYPES = installed(TALKER_TYPES)
QWEN25 = installed(TALKER_TYPES[:1])
QWEN3 = installed(TALKER_TYPES[1:])
ALWAYS = {"kernels": {"skip_logits": "always", "loss_chunk_size": 8}}
NPU_OPS = ("npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_cross_entropy_loss")


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _relative(expected: dict, actual: dict) -> float:
    """The largest per-parameter relative difference ||actual - expected|| / ||expected|| (keys must match)."""
    assert expected and expected.keys() == actual.keys(), set(expected) ^ set(actual)
    return max(((actual[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in expected.items())


def _shifted_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The one-shift causal-LM alignment on HF's logits: position t scored on the codec id at t + 1."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


def _talker_inputs(model_type: str, model, **kwargs) -> dict:
    return (talker_batch if model_type == "qwen2_5_omni_talker" else qwen3_talker_batch)(model, **kwargs)


def _reference(model, batch: dict) -> tuple[torch.Tensor, dict]:
    """Plain HF: the forward without labels, F.cross_entropy on its codec_head logits (+ the MoE aux loss as HF
    weighs it), and the gradients."""
    model.zero_grad(set_to_none=True)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    out = model(**inputs)
    loss = _shifted_ce(out.logits, batch["labels"])
    if getattr(out, "aux_loss", None) is not None:
        loss = loss + model.router_aux_loss_coef * out.aux_loss
    loss.backward()
    return loss.detach(), _grads(model)


def _ours(model, batch: dict) -> tuple[torch.Tensor, dict, object]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), _grads(model), out


def _count_npu(monkeypatch) -> dict[str, int]:
    import torch_npu

    calls: dict[str, int] = {}

    def counting(name, original):
        def counted(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)
        return counted

    for name in NPU_OPS:
        monkeypatch.setattr(torch_npu, name, counting(name, getattr(torch_npu, name)))
    return calls


@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_padded"])
@pytest.mark.parametrize("model_type", TYPES)
def test_talker_loss_parity(model_type, backend, left, monkeypatch):
    """Codec labels: our fused loss equals cross-entropy on HF's own codec_head logits with one shift, gradients
    too; report() and the kernels that ran say the decoder and the loss are ours."""
    model = tiny_talker(model_type)
    qwen3 = model_type == "qwen3_omni_moe_talker"
    batch = _talker_inputs(model_type, model, left=left)
    if qwen3:
        batch["output_router_logits"] = True  # the router's aux loss joins the loss, as HF adds it
    expected = _reference(model, batch)
    calls = _count_npu(monkeypatch) if backend == "npu" else {}
    mindspeed_hf.enable(config_from_dict({"backend": backend, **ALWAYS}))
    report = mindspeed_hf.apply_to_model(model)
    layers = 2
    kernels = report["kernels"]
    assert report["model_type"] == model_type and report["attention_implementation"] == "mindspeed"
    assert kernels["attention"] == kernels["rope"] == layers * (2 if qwen3 else 1)  # + the code predictor's
    assert kernels["fused_linear_cross_entropy"] == (2 if qwen3 else 1)
    assert kernels["rms_norm"] == (18 if qwen3 else 2 * layers + 1)
    # Qwen3-Omni: shared experts and the predictor's MLPs (4.57: one MLP module per routed expert too)
    mlps = sum(type(m).__name__ in ("Qwen3OmniMoeTalkerTextMLP", "Qwen3OmniMoeMLP") for m in model.modules())
    assert kernels["swiglu"] == (mlps if qwen3 else layers) and (not qwen3 or mlps >= 2 * layers)
    assert kernels["experts"] == (layers if qwen3 and experts.available() and backend == "npu" else 0)
    model.train()
    loss, grads, out = _ours(model, batch)
    assert isinstance(out.logits, SkippedLogits)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert _relative(expected[1], grads) < 1e-4
    assert any("codec_head" in n for n in grads) and any("layers.1.self_attn.q_proj" in n for n in grads)
    ran = mindspeed_hf.report(model)["ran"]
    assert ran["fused_linear_cross_entropy"] == 1 and ran["rope"] >= layers and ran["attention"] >= layers
    assert ran["rms_norm"] >= 2 * layers + 1 and ran["swiglu"] >= layers
    if backend == "npu":  # the NPU ops ran: norms, rope, attention, SwiGLU and the loss's cross-entropy
        assert all(calls.get(name, 0) > 0 for name in NPU_OPS), calls


@pytest.mark.parametrize("model_type", QWEN3)
def test_code_predictor_scores_each_codebook_once(backend, model_type):
    """Head j scores codebook j + 1 (HF's own head j: its forward on the first j + 2 positions), all heads of every
    frame in one forward; HF's own labels path (one head for every position, labels shifted again) differs."""
    model = tiny_talker(model_type)
    predictor = model.code_predictor
    batch = code_predictor_batch(model)
    embeds, labels = batch["inputs_embeds"], batch["labels"]
    hf_loss = predictor(**batch).loss.item()
    predictor.zero_grad(set_to_none=True)
    total = 0.0
    for j in range(labels.shape[1] - 1):  # HF picks head j for a (j + 2)-position prefill
        logits = predictor(inputs_embeds=embeds[:, :j + 2]).logits[:, -1]
        total = total + F.cross_entropy(logits, labels[:, j + 1], ignore_index=-100, reduction="sum")
    expected = total / (labels[:, 1:] != -100).sum()
    expected.backward()
    expected_grads = _grads(predictor)
    mindspeed_hf.enable(config_from_dict({"backend": backend, **ALWAYS}))
    mindspeed_hf.apply_to_model(model)
    predictor.train()
    loss, grads, _ = _ours(predictor, batch)
    torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
    assert abs(loss.item() - hf_loss) > 1e-3  # HF's own labels path is another objective
    assert _relative(expected_grads, grads) < 1e-4
    assert {n.split(".")[1] for n in grads if n.startswith("lm_head.")} == {"0", "1", "2"}  # every head trained
    assert mindspeed_hf.report(model)["ran"]["fused_linear_cross_entropy"] == labels.shape[1] - 1
    with torch.no_grad():  # the logits path (HF's loss function on every head's logits): the same loss
        full = predictor(**batch, skip_logits=False)
        heads = [predictor(inputs_embeds=embeds[:, :j + 2], skip_logits=False).logits[:, -1] for j in range(3)]
    torch.testing.assert_close(full.loss, expected.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full.logits, torch.stack(heads, dim=1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", TYPES)
def test_logits_plans(model_type):
    """Outside Trainer the logits are made on first read (HF's, HF's dtype); skip_logits=False and the loss kernel
    switched off take HF's logits and HF's loss function: the same loss."""
    model = tiny_talker(model_type)
    batch = _talker_inputs(model_type, model)
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    expected = _shifted_ce(logits, batch["labels"])
    mindspeed_hf.enable(config_from_dict({"backend": "torch"}))
    mindspeed_hf.apply_to_model(model)
    with torch.no_grad():
        out = model(**batch)
        assert isinstance(out.logits, DeferredLogits) and out.logits._value is None  # not made yet
        torch.testing.assert_close(out.loss, expected, atol=1e-5, rtol=1e-5)
        assert out.logits.dtype == logits.dtype
        torch.testing.assert_close(out.logits + 0, logits, atol=1e-5, rtol=1e-5)
        full = model(**batch, skip_logits=False)
        torch.testing.assert_close(full.logits, logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(full.loss, expected, atol=1e-5, rtol=1e-5)
    mindspeed_hf.enable(config_from_dict({"backend": "torch", "kernels": {"fused_linear_cross_entropy": False}}))
    mindspeed_hf.apply_to_model(model)
    with torch.no_grad():
        off = model(**batch)
    torch.testing.assert_close(off.loss, expected, atol=1e-5, rtol=1e-5)
    assert mindspeed_hf.report(model)["kernels"]["fused_linear_cross_entropy"] == 0


@pytest.mark.parametrize("model_type", TYPES)
def test_bf16_logits_keep_hf_dtype(model_type):
    """bf16 weights: the logits made on first read have HF's dtype (Qwen2.5-Omni casts its codec logits to fp32,
    Qwen3-Omni keeps bf16) and HF's values; the loss is HF's within bf16 rounding."""
    model = tiny_talker(model_type).to(torch.bfloat16)
    batch = _talker_inputs(model_type, model)
    batch["inputs_embeds"] = batch["inputs_embeds"].to(torch.bfloat16)
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        mindspeed_hf.enable(config_from_dict({"backend": "torch"}))
        mindspeed_hf.apply_to_model(model)
        out = model(**batch)
        assert out.logits.dtype == logits.dtype == (torch.float32 if "qwen2" in model_type else torch.bfloat16)
        torch.testing.assert_close(out.logits + 0, logits, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(out.loss, _shifted_ce(logits, batch["labels"]), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("model_type", TYPES)
def test_no_labels_forward_is_hf(model_type):
    """Without labels (generation) the forward is HF's: the same logits, and for Qwen2.5-Omni the same prefill
    (which writes the codec pad / bos embeddings into inputs_embeds, as HF's does)."""
    model = tiny_talker(model_type)
    batch = {k: v for k, v in _talker_inputs(model_type, model).items() if k not in ("labels", "position_ids")}
    embeds = batch["inputs_embeds"]
    with torch.no_grad():
        hf_embeds = embeds.clone()
        expected = model(**{**batch, "inputs_embeds": hf_embeds}).logits
        mindspeed_hf.enable(config_from_dict({"backend": "torch"}))
        mindspeed_hf.apply_to_model(model)
        ours_embeds = embeds.clone()
        logits = model(**{**batch, "inputs_embeds": ours_embeds}).logits
    assert type(logits) is torch.Tensor
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_embeds, hf_embeds)  # HF's prefill edits, identically
    if model_type == "qwen3_omni_moe_talker":
        cp = code_predictor_batch(model)
        with torch.no_grad():
            torch.testing.assert_close(model.code_predictor(inputs_embeds=cp["inputs_embeds"]).logits,
                                       _plain(model_type).code_predictor(inputs_embeds=cp["inputs_embeds"]).logits,
                                       atol=1e-5, rtol=1e-5)


def _plain(model_type: str):
    """A second copy of the tiny model (same seed), built while disabled: HF's classes untouched."""
    enabled = mindspeed_hf.patches.apply.is_enabled()
    mindspeed_hf.disable()
    try:
        return tiny_talker(model_type)
    finally:
        if enabled:
            mindspeed_hf.enable(config_from_dict({"backend": "torch"}))


@pytest.mark.parametrize("model_type", QWEN25)
def test_greedy_generation_is_hf(model_type):
    """HF's talker generate (prefill from thinker states, then one codec id + one reply state per step): the same
    greedy codes with the accelerator."""
    gen = torch.Generator().manual_seed(5)
    prompt = 4
    ids = torch.tensor([[CODEC_MASK] * prompt + [CODEC_PAD, CODEC_BOS]])
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), input_text_ids=torch.arange(10, 16)[None],
                  thinker_reply_part=torch.randn(1, 6, THINKER_WIDTH, generator=gen), max_new_tokens=5,
                  do_sample=False, eos_token_id=CODEC_EOS, pad_token_id=CODEC_PAD)
    embeds = torch.randn(1, prompt + 2, THINKER_WIDTH, generator=gen)
    model = tiny_talker(model_type)
    expected = model.generate(inputs_embeds=embeds.clone(), **kwargs)
    mindspeed_hf.enable(config_from_dict({"backend": "torch"}))
    mindspeed_hf.apply_to_model(model)
    model.rope_deltas = None
    assert torch.equal(model.generate(inputs_embeds=embeds.clone(), **kwargs), expected)


@pytest.mark.parametrize("model_type", QWEN25)
def test_training_forward_leaves_inputs_embeds_alone(model_type):
    """With labels, an attention mask and no position_ids, HF's prefill branch would add the codec pad / bos
    embeddings into the caller's inputs_embeds in place: the training forward takes HF's get_rope_index positions
    instead, and neither the inputs nor the model's rope_deltas change."""
    model = tiny_talker(model_type)
    batch = talker_batch(model)
    positions = batch.pop("position_ids")
    torch.testing.assert_close(model.get_rope_index(None, None, None, batch["attention_mask"])[0], positions)
    with torch.no_grad():
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        expected = _shifted_ce(model(**inputs, position_ids=positions).logits, batch["labels"])
        edited = batch["inputs_embeds"].clone()
        model(inputs_embeds=edited, attention_mask=batch["attention_mask"])  # HF, no positions: edits its input
    assert not torch.equal(edited, batch["inputs_embeds"])
    model.rope_deltas = None
    mindspeed_hf.enable(config_from_dict({"backend": "torch", **ALWAYS}))
    mindspeed_hf.apply_to_model(model)
    before = batch["inputs_embeds"].clone()
    model.train()
    loss = model(**batch).loss
    assert torch.equal(batch["inputs_embeds"], before) and model.rope_deltas is None
    torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", TYPES)
def test_lora_on_the_talker(model_type, backend):
    """PEFT LoRA on every projection of the decoder and on codec_head: loss and adapter gradients equal plain HF +
    PEFT (cross-entropy on its codec_head logits)."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "codec_head"]
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    reference = get_peft_model(tiny_talker(model_type), lora)
    batch = _talker_inputs(model_type, reference.base_model.model)
    expected = _reference(reference, batch)
    model = get_peft_model(tiny_talker(model_type), lora)
    mindspeed_hf.enable(config_from_dict({"backend": backend, **ALWAYS}))
    assert mindspeed_hf.apply_to_model(model)["kernels"]["fused_linear_cross_entropy"] >= 1
    loss, grads, _ = _ours(model, batch)
    assert grads and all("lora_" in n for n in grads) and any("codec_head.lora_" in n for n in grads)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert _relative(expected[1], grads) < 1e-4
    assert mindspeed_hf.report(model)["ran"]["fused_linear_cross_entropy"] == 1


@pytest.mark.parametrize("model_type", TYPES)
def test_trainer_sees_labels_and_disable_restores(model_type):
    """Trainer keeps the `labels` column (the patched forward's signature has it; Qwen2.5-Omni's HF forward has
    none), and disable() puts HF's forward back (Qwen2.5-Omni: no labels again)."""
    from transformers.utils import find_labels

    model = tiny_talker(model_type)
    cls = type(model)
    original = cls.forward
    mindspeed_hf.enable()
    assert find_labels(cls) == ["labels"]
    mindspeed_hf.disable()
    assert cls.forward is original
    assert find_labels(cls) == ([] if model_type == "qwen2_5_omni_talker" else ["labels"])


@pytest.mark.parametrize("model_type", QWEN3)
def test_code_predictor_bad_labels_one_line(model_type):
    model = tiny_talker(model_type)
    batch = code_predictor_batch(model)
    mindspeed_hf.enable()
    mindspeed_hf.apply_to_model(model)
    with pytest.raises(ValueError, match=r"^labels: the code predictor takes one code per input position") as error:
        model.code_predictor(inputs_embeds=batch["inputs_embeds"], labels=batch["labels"][:, 1:])
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("model_type", QWEN25)
def test_talker_labels_need_inputs_embeds_one_line(model_type):
    model = tiny_talker(model_type)
    mindspeed_hf.enable()
    mindspeed_hf.apply_to_model(model)
    ids = torch.tensor([[CODEC_PAD, CODEC_BOS, 3, 4]])
    with pytest.raises(ValueError, match=r"^labels: the Qwen2.5-Omni talker trains on inputs_embeds") as error:
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids,
              thinker_reply_part=torch.zeros(1, 1, THINKER_WIDTH))
    assert "\n" not in str(error.value)


def test_fsdp_units_split_the_code_predictor():
    """FSDP2's groups for Qwen3-Omni's talker: HF lists the whole code predictor as one unit; ours are its decoder
    layers, so the predictor's codebook tables stay in the root group (a script embeds frames with them outside
    the predictor's forward: tests/trainer/test_omni_talker_example.py runs it under FSDP2 x EP)."""
    from mindspeed_hf.parallel.fsdp import find_decoder_layers

    model = tiny_talker("qwen3_omni_moe_talker")
    whole = type(model.code_predictor).__name__
    if whole not in model.code_predictor._no_split_modules:
        pytest.skip("this transformers release does not list the code predictor as one unit")
    layers = find_decoder_layers(model)
    assert layers == [*model.model.layers, *model.code_predictor.model.layers]
    assert find_decoder_layers(model, [whole]) == [model.code_predictor]  # a stated class is kept as given
