"""The Omni thinkers (Qwen2.5-Omni; Qwen3-Omni's MoE one): text model, vision tower, Whisper-style audio tower - loss
and every gradient equal the
unpatched model (fp32, 1e-5) on the torch and npu backends, for a batch with two audio clips of different lengths
and two images of different grids, text padded right or left; report() counts the audio tower's attention apart;
on the NPU path the audio attention is one npu_fusion_attention (TND) per encoder layer over every window of every
clip, with the window boundaries HF computed, and the vision attention one per block over every image."""

import pytest
import torch
from tiny_models import assert_close_grads, installed, loss_and_grads, modeling_of
from tiny_omni import FRAMES, OMNI_TYPES, omni_batch, tiny_omni_thinker

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.device import import_torch_npu
from mindspeed_hf.patches import FAMILIES, experts

CONFIG = {"kernels": {"skip_logits": "always", "loss_chunk_size": 16}}


def _towers_ours(model_type: str) -> tuple[bool, bool]:
    """(vision, audio): whether each tower's attention runs ours on this release. The vision tower needs cos/sin
    passed in (Qwen2.5-Omni before transformers 5.20 rotates one tensor by its freqs inside); the audio attention
    must take the windows' cu_seqlens alone (before 5.20 it also takes an attention mask and returns a tuple).
    Where not, that tower stays HF's (the text model and the loss are ours)."""
    import inspect

    modeling = modeling_of(model_type)
    family = FAMILIES[model_type]
    vision, audio = (inspect.signature(getattr(modeling, name[0]).forward).parameters
                     for name in (family.vision_attention, family.audio_attention))
    return "position_embeddings" in vision, "attention_mask" not in audio


TYPES = installed(OMNI_TYPES)


def _audio_boundaries(model) -> list[list[int]]:
    """The cu_seqlens HF hands each audio attention layer (recorded by a pre-hook: HF's own computation)."""
    seen: list[list[int]] = []
    for module in model.modules():
        if type(module).__name__.endswith("AudioAttention"):
            module.register_forward_pre_hook(
                lambda m, a, kw: seen.append(kw.get("cu_seqlens", a[1] if len(a) > 1 else None)[1:].tolist()),
                with_kwargs=True)
    return seen


@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_padded"])
@pytest.mark.parametrize("model_type", TYPES)
def test_thinker_parity(model_type, backend, left, monkeypatch):
    model = tiny_omni_thinker(model_type)
    vision_ours, audio_ours = _towers_ours(model_type)
    qwen3 = model_type.startswith("qwen3")
    batch = omni_batch(model, left=left)
    expected = loss_and_grads(model, batch)
    calls = []
    if backend == "npu":
        npu = import_torch_npu()
        real = npu.npu_fusion_attention

        def counting(*args, **kwargs):
            if kwargs.get("atten_mask") is None:  # the towers' (text attention is causal, with a mask)
                calls.append(tuple(kwargs.get("actual_seq_qlen") or ()))
            return real(*args, **kwargs)

        monkeypatch.setattr(npu, "npu_fusion_attention", counting)
    boundaries = _audio_boundaries(model)

    mindspeed_hf.enable(config_from_dict({"backend": backend, **CONFIG}))
    report = mindspeed_hf.apply_to_model(model)
    layers = model.config.text_config.num_hidden_layers
    assert report["kernels"]["attention"] == report["kernels"]["rope"] == layers
    assert report["kernels"]["fused_linear_cross_entropy"] == 1
    # Qwen3-Omni: every layer MoE, no shared expert (4.57: one MLP module per expert)
    mlps = sum(type(m).__name__ == "Qwen3OmniMoeThinkerTextMLP" for m in model.modules())
    assert report["kernels"]["swiglu"] == (mlps if qwen3 else layers)
    assert report["kernels"]["experts"] == (layers if qwen3 and experts.available() and backend == "npu" else 0)
    depth = model.config.vision_config.depth
    # Qwen3-Omni's tower: LayerNorm and GELU MLPs (HF's), like Qwen3-VL's
    assert report["vision_kernels"] == {"rms_norm": 0 if qwen3 else 2 * depth + 1, "rope": depth if vision_ours else 0,
                                        "swiglu": 0 if qwen3 else depth, "attention": depth if vision_ours else 0}
    audio_layers = model.config.audio_config.encoder_layers if audio_ours else 0
    assert report["audio_kernels"] == {"attention": audio_layers}
    model.train()
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)
    assert any("audio_tower." in name for name in grads) and any("visual." in name for name in grads)
    assert mindspeed_hf.report(model)["ran"]["vision_attention"] == (depth if vision_ours else 0) + audio_layers
    if backend == "npu" and audio_ours:
        audio = boundaries[-audio_layers:]  # this forward's, HF's own window boundaries
        # every window of both clips (Qwen2.5-Omni: 16-frame windows; Qwen3-Omni's attention window spans these
        # short clips whole) in one call per layer
        assert len(set(map(tuple, audio))) == 1 and len(audio[0]) >= len(FRAMES)
        assert [list(c) for c in calls if list(c) == audio[0]] == audio  # one TND call per encoder layer
        assert len(calls) == (depth if vision_ours else 0) + audio_layers


@pytest.mark.parametrize("model_type", TYPES)
def test_explicit_attention_keeps_hf_audio_path(model_type):
    model = tiny_omni_thinker(model_type, attn_implementation="eager")
    mindspeed_hf.enable()
    report = mindspeed_hf.apply_to_model(model)
    assert report["audio_kernels"] == {"attention": 0} and report["attention_implementation"] == "eager"


@pytest.mark.parametrize("model_type", TYPES)
def test_context_parallel_checked_per_release(model_type):
    """cp splits inside the thinker (tests/distributed/test_context_parallel_vlm.py) where it has a
    `model.language_model` (transformers >= 5.23); before, one line refuses it."""
    from mindspeed_hf.parallel.context.model import check_context_parallel

    model = tiny_omni_thinker(model_type)
    if hasattr(model.model, "language_model"):
        check_context_parallel(model, ulysses=2)
        return
    with pytest.raises(ValueError, match=rf"parallel.cp: {model_type} has no `model.language_model` .* valid "
                                         r"choices: parallel.cp=1") as error:
        check_context_parallel(model, ulysses=1)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("model_type", TYPES)
def test_lora_on_the_thinker(model_type):
    """PEFT LoRA on every projection of the thinker (text, vision and audio towers): loss and adapter gradients equal
    the unpatched PEFT model's."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "q", "k", "v", "qkv", "gate_proj", "up_proj",
               "down_proj", "fc1", "fc2"]  # (PEFT's "all-linear" refuses a Qwen3-Omni audio layer by itself)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    batch = omni_batch(tiny_omni_thinker(model_type))
    expected = loss_and_grads(get_peft_model(tiny_omni_thinker(model_type), lora), batch)
    model = get_peft_model(tiny_omni_thinker(model_type), lora)
    mindspeed_hf.enable(config_from_dict({"backend": "npu"}))
    mindspeed_hf.apply_to_model(model)
    loss, grads = loss_and_grads(model, batch)
    assert grads and all("lora_" in name for name in grads) and any("audio_tower" in name for name in grads)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)
