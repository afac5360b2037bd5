"""Qwen2.5-Omni's thinker (text model, vision tower, Whisper-style audio tower): loss and every gradient equal the
unpatched model (fp32, 1e-5) on the torch and npu backends, for a batch with two audio clips of different lengths
and two images of different grids, text padded right or left; report() counts the audio tower's attention apart;
on the NPU path the audio attention is one npu_fusion_attention (TND) per encoder layer over every window of every
clip, with the window boundaries HF computed, and the vision attention one per block over every image."""

import pytest
import torch
from tiny_models import assert_close_grads, loss_and_grads
from tiny_omni import GRIDS, omni_batch, tiny_omni_thinker

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.device import import_torch_npu

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not hasattr(transformers, "Qwen2_5OmniThinkerForConditionalGeneration"),
                                reason="no Qwen2.5-Omni in this transformers release")
CONFIG = {"kernels": {"skip_logits": "always", "loss_chunk_size": 16}}


def _towers_patched() -> bool:
    """transformers >= 5.20: the audio attention takes the windows' cu_seqlens alone and the vision tower passes
    cos/sin; before, the audio attention also takes an attention mask and returns a tuple, and the vision rope
    rotates one tensor by its freqs: both towers stay HF's there (the text model and the loss are ours)."""
    import inspect

    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as modeling

    return "attention_mask" not in inspect.signature(modeling.Qwen2_5OmniAudioAttention.forward).parameters


TOWERS = hasattr(transformers, "Qwen2_5OmniThinkerForConditionalGeneration") and _towers_patched()


def _audio_boundaries(model) -> list[list[int]]:
    """The cu_seqlens HF hands each audio attention layer (recorded by a pre-hook: HF's own computation)."""
    seen: list[list[int]] = []
    for module in model.modules():
        if type(module).__name__ == "Qwen2_5OmniAudioAttention":
            module.register_forward_pre_hook(
                lambda m, a, kw: seen.append(kw.get("cu_seqlens", a[1] if len(a) > 1 else None)[1:].tolist()),
                with_kwargs=True)
    return seen


@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_padded"])
def test_thinker_parity(backend, left, monkeypatch):
    model = tiny_omni_thinker()
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
    assert report["kernels"]["fused_linear_cross_entropy"] == 1 and report["kernels"]["swiglu"] == layers
    depth = model.config.vision_config.depth
    assert report["vision_kernels"] == {"rms_norm": 2 * depth + 1, "rope": depth if TOWERS else 0, "swiglu": depth,
                                        "attention": depth}
    audio_layers = model.config.audio_config.encoder_layers if TOWERS else 0
    assert report["audio_kernels"] == {"attention": audio_layers}
    model.train()
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(expected[1], grads)
    assert any("audio_tower." in name for name in grads) and any("visual." in name for name in grads)
    assert mindspeed_hf.report(model)["ran"]["vision_attention"] == (depth + audio_layers if TOWERS else 0)
    if backend == "npu" and TOWERS:
        audio = boundaries[-audio_layers:]  # this forward's, HF's own window boundaries
        assert len(set(map(tuple, audio))) == 1 and len(audio[0]) > len(GRIDS)  # windows of both clips, one call
        assert [list(c) for c in calls if list(c) == audio[0]] == audio  # one TND call per encoder layer
        assert len(calls) == depth + audio_layers


def test_explicit_attention_keeps_hf_audio_path():
    model = tiny_omni_thinker(attn_implementation="eager")
    mindspeed_hf.enable()
    report = mindspeed_hf.apply_to_model(model)
    assert report["audio_kernels"] == {"attention": 0} and report["attention_implementation"] == "eager"
