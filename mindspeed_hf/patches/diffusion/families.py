"""One declarative entry per supported diffusers denoiser family: the modeling module, its model classes, its
transformer blocks, which attention calls, rope functions, norms and activations get which kernel.

Where a denoiser's code reaches each kernel (read from the installed diffusers, 0.42):
- attention: the DiT processors call their module's `dispatch_attention_fn` (diffusers' attention dispatcher);
  attention_processor.py's processors (SD3's joint attention, SDXL's UNet, HunyuanVideo's token refiner) call
  `F.scaled_dot_product_attention` directly.
- rope: a module-level function (`apply_rotary_emb` imported from embeddings, Qwen-Image's `apply_rotary_emb_qwen`),
  a function HunyuanVideo's processor imports from embeddings on every call, or a function nested inside Wan's
  processor (its processor call is ours, `rope_processor_calls`).
- q/k RMSNorm: torch.nn.RMSNorm (Flux, Flux.2, Wan across heads) or diffusers' normalization.RMSNorm.
- Flux.2's feed-forward is a packed SwiGLU (`Flux2SwiGLU`).
Adding a family is adding an entry here (and its parity test in tests/models/test_diffusion_families.py).
"""

from __future__ import annotations

from dataclasses import dataclass

TRANSFORMERS = "diffusers.models.transformers."


@dataclass(frozen=True)
class DenoiserFamily:
    """Names in a diffusers modeling module (`module`) that the accelerator patches or counts."""

    name: str
    module: str
    models: tuple[str, ...]  # the ModelMixin classes (their __init__ settles each model built while enabled)
    blocks: tuple[str, ...]  # transformer blocks: scope, recompute, offload and FSDP2 units (by class name)
    attention: tuple[str, ...]  # attention module classes (counted by report())
    # processors (by class name) whose attention is ours: `dispatch` ones call the module's dispatch_attention_fn,
    # `sdpa` ones attention_processor.py's F.scaled_dot_product_attention
    dispatch_processors: tuple[str, ...] = ()
    sdpa_processors: tuple[str, ...] = ()
    rope: str = ""  # the module-level rope function that becomes ours
    rope_processors: tuple[str, ...] = ()  # processors that apply rope (self / joint attention layers)
    local_rope: tuple[str, ...] = ()  # processors that import embeddings.apply_rotary_emb inside their call
    rope_processor_calls: tuple[str, ...] = ()  # processors whose rope is nested in their call: the call is ours
    swiglu: tuple[str, ...] = ()  # packed SwiGLU activation modules (silu(first half) * second half)


DENOISERS: dict[str, DenoiserFamily] = {
    family.name: family
    for family in (
        DenoiserFamily(
            "flux", TRANSFORMERS + "transformer_flux", ("FluxTransformer2DModel",),
            blocks=("FluxTransformerBlock", "FluxSingleTransformerBlock"), attention=("FluxAttention",),
            dispatch_processors=("FluxAttnProcessor", "FluxIPAdapterAttnProcessor"), rope="apply_rotary_emb",
            rope_processors=("FluxAttnProcessor", "FluxIPAdapterAttnProcessor")),
        # Flux.2: the same attention / rope / norm sites; one fused to_qkv_mlp_proj in its single blocks, SwiGLU MLPs
        DenoiserFamily(
            "flux2", TRANSFORMERS + "transformer_flux2", ("Flux2Transformer2DModel",),
            blocks=("Flux2TransformerBlock", "Flux2SingleTransformerBlock"),
            attention=("Flux2Attention", "Flux2ParallelSelfAttention"),
            dispatch_processors=("Flux2AttnProcessor", "Flux2ParallelSelfAttnProcessor"), rope="apply_rotary_emb",
            rope_processors=("Flux2AttnProcessor", "Flux2ParallelSelfAttnProcessor"), swiglu=("Flux2SwiGLU",)),
        # SD3 / SD3.5: joint attention in attention_processor.py (F.sdpa), q/k RMSNorm when qk_norm="rms_norm"
        DenoiserFamily(
            "sd3", TRANSFORMERS + "transformer_sd3", ("SD3Transformer2DModel",),
            blocks=("JointTransformerBlock", "SD3SingleTransformerBlock"), attention=("Attention",),
            sdpa_processors=("JointAttnProcessor2_0", "AttnProcessor2_0")),
        # SDXL's UNet: self- and cross-attention of its BasicTransformerBlocks (AttnProcessor2_0, F.sdpa)
        DenoiserFamily(
            "sdxl_unet", "diffusers.models.unets.unet_2d_condition", ("UNet2DConditionModel",),
            blocks=("BasicTransformerBlock",), attention=("Attention",), sdpa_processors=("AttnProcessor2_0",)),
        # Wan 2.x (text-to-video, image-to-video with its image cross-attention): 3-D video rope in self-attention
        DenoiserFamily(
            "wan", TRANSFORMERS + "transformer_wan", ("WanTransformer3DModel",), blocks=("WanTransformerBlock",),
            attention=("WanAttention",), dispatch_processors=("WanAttnProcessor",),
            rope_processors=("WanAttnProcessor",), rope_processor_calls=("WanAttnProcessor",)),
        # Qwen-Image: joint text+image attention with the text mask, complex-frequency rope on both streams
        DenoiserFamily(
            "qwenimage", TRANSFORMERS + "transformer_qwenimage", ("QwenImageTransformer2DModel",),
            blocks=("QwenImageTransformerBlock",), attention=("Attention",),
            dispatch_processors=("QwenDoubleStreamAttnProcessor2_0",), rope="apply_rotary_emb_qwen",
            rope_processors=("QwenDoubleStreamAttnProcessor2_0",)),
        # HunyuanVideo: dual- and single-stream blocks (dispatcher, rope on the video tokens), and the text token
        # refiner's attention (attention_processor.py's AttnProcessor2_0 with its 4-D text mask)
        DenoiserFamily(
            "hunyuan_video", TRANSFORMERS + "transformer_hunyuan_video", ("HunyuanVideoTransformer3DModel",),
            blocks=("HunyuanVideoTransformerBlock", "HunyuanVideoSingleTransformerBlock",
                    "HunyuanVideoTokenReplaceTransformerBlock", "HunyuanVideoTokenReplaceSingleTransformerBlock",
                    "HunyuanVideoIndividualTokenRefinerBlock"),
            attention=("Attention",), dispatch_processors=("HunyuanVideoAttnProcessor2_0",),
            sdpa_processors=("AttnProcessor2_0",), rope_processors=("HunyuanVideoAttnProcessor2_0",),
            local_rope=("HunyuanVideoAttnProcessor2_0",)),
    )
}


def denoiser_family(classes: tuple[str, ...]) -> DenoiserFamily | None:
    """The entry whose model classes include one of `classes` (a model's class and base-class names)."""
    return next((f for f in DENOISERS.values() if set(f.models) & set(classes)), None)
