"""One declarative entry per supported model family: which classes and functions of its transformers modeling
module get which kernel. Adding a family is adding an entry here (plus its parity test)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFamily:
    """Names in `transformers.models.<module>.modeling_<module>` that the accelerator patches."""

    model_type: str
    module: str
    pretrained: str  # XPreTrainedModel: its attention default becomes ours
    attention: str  # XAttention, counted for the rope/attention report
    causal_lm: tuple[str, ...]
    rms_norm: tuple[str, ...] = ()
    offset_rms_norm: bool = False  # Gemma: x * (1 + w), multiplied in fp32
    swiglu_mlp: tuple[str, ...] = ()  # gate_proj / up_proj / down_proj MLPs
    packed_swiglu_mlp: tuple[str, ...] = ()  # gate_up_proj / down_proj MLPs (Phi-3)
    # Its module-level rope functions that run the rope kernel, (function name, its layout in forwards.ROPE_LAYOUTS):
    # HF's usual apply_rotary_pos_emb, or the family's own; () keeps the module's rope HF's
    rope_layouts: tuple[tuple[str, str], ...] = (("apply_rotary_pos_emb", "half"),)
    # XDecoderLayer: its residual add fused into the norm after it (add_rms_norm), where its forward is one of the
    # shapes in forwards.LAYER_SHAPES (checked on the installed release; any other forward is left as HF's).
    decoder_layer: str = ""
    experts: tuple[str, ...] = ()  # fused 3-D experts classes (transformers >= 5): the grouped-GEMM experts kernel
    # A third-party modeling module (full path): patched once its package is imported, never imported by us.
    modeling: str = ""
    # (XAttention, its module-level multimodal rope function): its tables folded, then the fused rope
    mrope_attention: tuple[tuple[str, str], ...] = ()
    # Vision-language models: the XForConditionalGeneration heads (fused loss), the vision tower's class (its kernels
    # are reported apart from the text ones), its packed-patch attention classes (one varlen call over all images),
    # and whether the tower's module-level apply_rotary_pos_emb_vision gets the rope kernel.
    vlm_heads: tuple[str, ...] = ()
    vision_model: str = ""
    vision_attention: tuple[str, ...] = ()
    vision_rope: bool = False
    # Omni models: the audio tower's class and its packed-chunk attention classes (one varlen call over all clips)
    audio_model: str = ""
    audio_attention: tuple[str, ...] = ()
    # LLaVA / InternVL: the language model is a stock family, the one named by config.text_config.model_type.
    text_from_config: bool = False
    # Hybrid linear attention (Qwen3-Next, Qwen3.5): the XGatedDeltaNet layers, their gated RMSNorm and the text
    # models whose forward finds packed documents (patches/linear_attention.py).
    linear_attention: str = ""
    # Its attention goes through AttentionInterface although the model class leaves _supports_attention_backend
    # (vLLM's flag, which compat.sdpa_replaceable reads) unset, as the hybrid models do.
    attention_interface: bool = False
    gated_rms_norm: str = ""
    text_models: tuple[str, ...] = ()
    # Omni talkers (patches/talker.py): the XTalkerForConditionalGeneration classes whose codec labels get the fused
    # loss on `codec_head`, the code predictors whose heads each score their own codebook, further attention classes
    # of the family's decoders on the module's apply_rotary_pos_emb (counted with the text ones), and top-level
    # classes found by name where the config's model_type is not the key (Qwen3-Omni's talker config has "").
    talker_heads: tuple[str, ...] = ()
    code_predictors: tuple[str, ...] = ()
    more_attention: tuple[str, ...] = ()
    model_classes: tuple[str, ...] = ()

    @property
    def rope(self) -> bool:
        """Its module-level rope runs the rope kernel."""
        return bool(self.rope_layouts)

    @property
    def modeling_module(self) -> str:
        return self.modeling or f"transformers.models.{self.module}.modeling_{self.module}"


def _dense(model_type: str, prefix: str, module: str | None = None, **overrides) -> ModelFamily:
    """The common Llama-shaped entry: XRMSNorm, XMLP, XAttention, XPreTrainedModel, XForCausalLM."""
    entry = dict(
        model_type=model_type,
        module=module or model_type,
        pretrained=f"{prefix}PreTrainedModel",
        attention=f"{prefix}Attention",
        causal_lm=(f"{prefix}ForCausalLM",),
        rms_norm=(f"{prefix}RMSNorm",),
        swiglu_mlp=(f"{prefix}MLP",),
        decoder_layer=f"{prefix}DecoderLayer",
    )
    entry.update(overrides)
    return ModelFamily(**entry)


def _vlm(model_type: str, prefix: str, **overrides) -> ModelFamily:
    """A vision-language entry: XForConditionalGeneration head, XVisionAttention on the packed patches, the
    vision rope, and XRMSNorm shared by the text model and (Qwen2.5-VL) the vision tower."""
    entry = dict(causal_lm=(), vlm_heads=(f"{prefix}ForConditionalGeneration",),
                 vision_attention=(f"{prefix}VisionAttention",), vision_rope=True, rms_norm=(f"{prefix}RMSNorm",),
                 decoder_layer="")  # add+norm not fused in the VLM text models yet (no parity test for it there)
    entry.update(overrides)
    return _dense(model_type, prefix, **entry)


def _linear_layers(prefix: str, text_model: str) -> dict:
    """The fields of a hybrid linear-attention model: Gated DeltaNet layers (XGatedDeltaNet, XRMSNormGated) among
    gated full-attention layers, offset RMSNorm (x * (1 + w)), partial rope."""
    return dict(offset_rms_norm=True, linear_attention=f"{prefix}GatedDeltaNet", attention_interface=True,
                gated_rms_norm=f"{prefix}RMSNormGated", text_models=(text_model,))


def _hybrid(model_type: str, prefix: str, text_model: str, **overrides) -> ModelFamily:
    return _dense(model_type, prefix, **{**_linear_layers(prefix, text_model), **overrides})


FAMILIES: dict[str, ModelFamily] = {
    family.model_type: family
    for family in (
        _dense("llama", "Llama"),
        _dense("mistral", "Mistral"),
        _dense("qwen2", "Qwen2"),
        _dense("qwen3", "Qwen3"),
        # MoE families: dense/shared MLPs on swiglu; routed experts on the grouped-GEMM experts kernel.
        _dense("qwen2_moe", "Qwen2Moe", experts=("Qwen2MoeExperts",)),
        _dense("qwen3_moe", "Qwen3Moe", experts=("Qwen3MoeExperts",)),
        _dense("mixtral", "Mixtral", swiglu_mlp=(), experts=("MixtralExperts",)),
        _dense("olmoe", "Olmoe", experts=("OlmoeExperts",)),
        # DeepSeek-V3: MLA attention; its default rope_interleave=True runs apply_rotary_pos_emb_interleave (pairs
        # turned, laid out evens then odds), rope_interleave=False the usual one.
        _dense("deepseek_v3", "DeepseekV3", experts=("DeepseekV3Experts",),
               rope_layouts=(("apply_rotary_pos_emb", "half"), ("apply_rotary_pos_emb_interleave", "interleaved"))),
        _dense("glm4_moe", "Glm4Moe", experts=("Glm4MoeExperts",)),
        # ERNIE 4.5: its apply_rotary_pos_emb turns interleaved pairs in place (GLM style) in fp32, and casts back or
        # not as the release has it (4.57: both to q's dtype; 5.x: q left in fp32, k not cast): rope stays HF's.
        _dense("ernie4_5_moe", "Ernie4_5_Moe", rope_layouts=(), experts=("Ernie4_5_MoeExperts",)),
        # GPT-OSS: its experts ([E, H, 2I] weights with biases, its own clamped gate), its rope (half-width tables)
        # and the loss. Its RMSNorm multiplies the weight in fp32 before the cast, and its attention has sinks (no
        # sdpa): not the layout of our kernels.
        _dense("gpt_oss", "GptOss", rms_norm=(), swiglu_mlp=(), experts=("GptOssExperts",), decoder_layer="",
               rope_layouts=(("apply_rotary_pos_emb", "half_width"),)),
        # Gemma: offset RMSNorm; its GeGLU MLP is left alone. Gemma2/3 ("sandwich" layers): the add after the
        # post-attention norm is fused into pre_feedforward_layernorm (offset form, exact in fp32); the add after
        # post_feedforward_layernorm feeds the next layer and stays a plain add.
        _dense("gemma", "Gemma", offset_rms_norm=True, swiglu_mlp=()),
        _dense("gemma2", "Gemma2", offset_rms_norm=True, swiglu_mlp=()),
        _dense("gemma3_text", "Gemma3", module="gemma3", offset_rms_norm=True, swiglu_mlp=()),
        # Phi-3: its residual adds go through dropout modules (resid_attn_dropout): not an add-then-norm shape.
        _dense("phi3", "Phi3", swiglu_mlp=(), packed_swiglu_mlp=("Phi3MLP",), decoder_layer=""),
        # Qwen3-TTS (the qwen-tts package): code predictor (1-D rope) and talker (multimodal rope); loss is the
        # example's (examples/qwen3_tts), not HF's causal-LM loss.
        _dense("qwen3_tts", "Qwen3TTS", modeling="qwen_tts.core.models.modeling_qwen3_tts", causal_lm=(),
               decoder_layer="",  # its talker / code-predictor layers are not Qwen3TTSDecoderLayer
               swiglu_mlp=("Qwen3TTSTalkerTextMLP",),
               mrope_attention=(("Qwen3TTSTalkerAttention", "apply_multimodal_rotary_pos_emb"),)),
        # Hybrid linear attention: Qwen3-Next (MoE with a shared expert), Qwen3.5 and Qwen3.5-MoE text models.
        _hybrid("qwen3_next", "Qwen3Next", "Qwen3NextModel", experts=("Qwen3NextExperts",)),
        _hybrid("qwen3_5_text", "Qwen3_5", "Qwen3_5TextModel", module="qwen3_5"),
        _hybrid("qwen3_5_moe_text", "Qwen3_5Moe", "Qwen3_5MoeTextModel", module="qwen3_5_moe",
                experts=("Qwen3_5MoeExperts",)),
        # Vision-language models: text parts as their dense / MoE cousins (mRoPE cos/sin come from the model's own
        # rotary module), vision towers on the varlen attention, vision rope, RMSNorm and SwiGLU-with-bias kernels.
        _vlm("qwen2_vl", "Qwen2VL", rms_norm=("Qwen2VLRMSNorm",), swiglu_mlp=("Qwen2MLP",),
             vision_model="Qwen2VisionTransformerPretrainedModel", vision_attention=("VisionAttention",)),
        _vlm("qwen2_5_vl", "Qwen2_5_VL", swiglu_mlp=("Qwen2_5_VLMLP", "Qwen2MLP"),
             vision_model="Qwen2_5_VisionTransformerPretrainedModel"),
        _vlm("qwen3_vl", "Qwen3VL", attention="Qwen3VLTextAttention", rms_norm=("Qwen3VLTextRMSNorm",),
             swiglu_mlp=("Qwen3VLTextMLP",), vision_model="Qwen3VLVisionModel"),
        _vlm("qwen3_vl_moe", "Qwen3VLMoe", attention="Qwen3VLMoeTextAttention", rms_norm=("Qwen3VLMoeTextRMSNorm",),
             swiglu_mlp=("Qwen3VLMoeTextMLP",), experts=("Qwen3VLMoeTextExperts",),
             vision_model="Qwen3VLMoeVisionModel"),
        # Qwen3.5 (-MoE): the hybrid text models above under a Qwen3-VL-style vision tower (no deepstack)
        _vlm("qwen3_5", "Qwen3_5", swiglu_mlp=("Qwen3_5MLP",), vision_model="Qwen3_5VisionModel",
             **_linear_layers("Qwen3_5", "Qwen3_5TextModel")),
        _vlm("qwen3_5_moe", "Qwen3_5Moe", swiglu_mlp=("Qwen3_5MoeMLP",), experts=("Qwen3_5MoeExperts",),
             vision_model="Qwen3_5MoeVisionModel", **_linear_layers("Qwen3_5Moe", "Qwen3_5MoeTextModel")),
        # Qwen2.5-Omni's thinker: text model, vision tower (separate q/k/v) and Whisper-style audio tower
        _vlm("qwen2_5_omni_thinker", "Qwen2_5Omni", module="qwen2_5_omni", swiglu_mlp=("Qwen2MLP", "Qwen2_5OmniMLP"),
             vlm_heads=("Qwen2_5OmniThinkerForConditionalGeneration",), vision_model="Qwen2_5OmniVisionEncoder",
             audio_model="Qwen2_5OmniAudioEncoder", audio_attention=("Qwen2_5OmniAudioAttention",)),
        # Qwen3-Omni's MoE thinker: Qwen3-VL-MoE-shaped text model and tower, the same audio tower shape
        _vlm("qwen3_omni_moe_thinker", "Qwen3OmniMoe", module="qwen3_omni_moe",
             attention="Qwen3OmniMoeThinkerTextAttention", rms_norm=("Qwen3OmniMoeThinkerTextRMSNorm",),
             swiglu_mlp=("Qwen3OmniMoeThinkerTextMLP",), experts=("Qwen3OmniMoeThinkerTextExperts",),
             vlm_heads=("Qwen3OmniMoeThinkerForConditionalGeneration",), vision_model="Qwen3OmniMoeVisionEncoder",
             audio_model="Qwen3OmniMoeAudioEncoder", audio_attention=("Qwen3OmniMoeAudioAttention",)),
        # The Omni talkers: the decoders under the codec heads, on the same kernels (the classes they share with the
        # thinker are patched once); the codec labels' loss fused (Qwen2.5-Omni's HF forward has none).
        _dense("qwen2_5_omni_talker", "Qwen2_5Omni", module="qwen2_5_omni", causal_lm=(), decoder_layer="",
               swiglu_mlp=("Qwen2MLP",), talker_heads=("Qwen2_5OmniTalkerForConditionalGeneration",)),
        # Qwen3-Omni's: MoE layers with a shared expert; its code predictor (dense, 1-D rope) in the same module
        _dense("qwen3_omni_moe_talker", "Qwen3OmniMoe", module="qwen3_omni_moe", causal_lm=(), decoder_layer="",
               pretrained="Qwen3OmniMoeThinkerTextPreTrainedModel", attention="Qwen3OmniMoeThinkerTextAttention",
               rms_norm=("Qwen3OmniMoeThinkerTextRMSNorm", "Qwen3OmniMoeTextRMSNorm", "Qwen3OmniMoeRMSNorm"),
               swiglu_mlp=("Qwen3OmniMoeTalkerTextMLP", "Qwen3OmniMoeMLP"), experts=("Qwen3OmniMoeTalkerTextExperts",),
               talker_heads=("Qwen3OmniMoeTalkerForConditionalGeneration",),
               code_predictors=("Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration",),
               more_attention=("Qwen3OmniMoeTalkerCodePredictorAttention",),
               model_classes=("Qwen3OmniMoeTalkerForConditionalGeneration",)),
        _vlm("llava", "Llava", attention="", rms_norm=(), swiglu_mlp=(), rope_layouts=(), vision_rope=False,
             vision_attention=(), text_from_config=True),
        _vlm("internvl", "InternVL", attention="", rms_norm=(), swiglu_mlp=(), rope_layouts=(), vision_rope=False,
             vision_attention=(), text_from_config=True),
    )
}


def family_for(model_type: str | None, classes: tuple[str, ...] = ()) -> ModelFamily | None:
    """The entry for a model: by its config's model_type, else by the name of its class or a base class."""
    family = FAMILIES.get(model_type)
    if family is None and classes:
        family = next((f for f in FAMILIES.values() if f.model_classes and set(f.model_classes) & set(classes)), None)
    return family
