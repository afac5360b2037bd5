"""Tiny diffusers denoisers built from config (fp32, CPU) and one training batch each, with the training loss the
official diffusers scripts use: flow matching (target noise - latents, loss weighting of SD3's scripts) for the DiTs,
epsilon prediction for SDXL's UNet. Shared by the diffusion tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

import diffusers  # noqa: E402
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3  # noqa: E402

BATCH = 2


@dataclass
class Tiny:
    """A model of one family, its batch, and the layers the kernels should meet per forward."""

    model: torch.nn.Module
    latents: torch.Tensor  # clean latents, in the layout the model's `hidden_states` takes
    inputs: dict[str, Any]  # every other forward argument
    hidden: str = "hidden_states"
    epsilon: bool = False  # SDXL: epsilon prediction on a UNet, else flow matching
    expect: dict[str, int] = field(default_factory=dict)  # npu calls per forward: attention / rope / rms_norm


def _seed(seed: int = 0) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def flux() -> Tiny:
    _seed()
    model = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=2,
                                             attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                             pooled_projection_dim=16, axes_dims_rope=(4, 2, 2))
    img, txt = 12, 6  # both multiples of 2: context parallelism splits Flux's text and image tokens
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(3.0), torch.arange(4.0), indexing="ij"), -1)
    inputs = dict(encoder_hidden_states=torch.randn(BATCH, txt, 16), pooled_projections=torch.randn(BATCH, 16),
                  img_ids=ids.reshape(img, 3), txt_ids=torch.zeros(txt, 3))
    # 3 attention layers (joint in the double block, over text + image in the single ones), rope on q and k of each,
    # q/k norms (text and image in the double block)
    return Tiny(model, torch.randn(BATCH, img, 8), inputs, expect=dict(attention=3, rope=6, rms_norm=8))


def flux2() -> Tiny:
    _seed()
    model = diffusers.Flux2Transformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                              attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                              timestep_guidance_channels=16, axes_dims_rope=(2, 2, 2, 2),
                                              guidance_embeds=False)
    img, txt = 12, 5
    img_ids = torch.zeros(img, 4)
    img_ids[:, 2], img_ids[:, 3] = torch.arange(img) // 4, torch.arange(img) % 4
    inputs = dict(encoder_hidden_states=torch.randn(BATCH, txt, 16), img_ids=img_ids, txt_ids=torch.zeros(txt, 4))
    return Tiny(model, torch.randn(BATCH, img, 8), inputs, expect=dict(attention=2, rope=4, rms_norm=6, swiglu=3))


def sd3() -> Tiny:
    _seed()
    model = diffusers.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                                            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                            caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
                                            qk_norm="rms_norm", dual_attention_layers=(0,))
    inputs = dict(encoder_hidden_states=torch.randn(BATCH, 6, 16), pooled_projections=torch.randn(BATCH, 16))
    # block 0: joint attention + its second (image-only) attention; block 1 (context_pre_only): joint attention
    return Tiny(model, torch.randn(BATCH, 4, 8, 8), inputs, expect=dict(attention=3, rope=0, rms_norm=10))


def sdxl_unet() -> Tiny:
    _seed()
    model = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=16, attention_head_dim=(2, 4), transformer_layers_per_block=(1, 1), norm_num_groups=4,
        addition_embed_type="text_time", addition_time_embed_dim=4, projection_class_embeddings_input_dim=32,
        use_linear_projection=True)
    inputs = dict(encoder_hidden_states=torch.randn(BATCH, 5, 16),
                  added_cond_kwargs=dict(text_embeds=torch.randn(BATCH, 8), time_ids=torch.rand(BATCH, 6) * 64))
    # transformer blocks: down (1), mid (1), up (2); self- and cross-attention in each
    return Tiny(model, torch.randn(BATCH, 4, 8, 8), inputs, hidden="sample", epsilon=True,
                expect=dict(attention=8, rope=0, rms_norm=0))


def wan(image_to_video: bool = False) -> Tiny:
    _seed()
    extra = dict(image_dim=16, added_kv_proj_dim=24) if image_to_video else {}
    model = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                            in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32,
                                            num_layers=2, cross_attn_norm=True, rope_max_seq_len=32, **extra)
    text = 512 if image_to_video else 7  # Wan's i2v processor takes the last 512 tokens as the text
    inputs = dict(encoder_hidden_states=torch.randn(BATCH, text, 16))
    if image_to_video:
        inputs["encoder_hidden_states_image"] = torch.randn(BATCH, 6, 16)
    # per block: self-attention (rope, q/k norms across heads) and cross-attention (+ the image attention in i2v)
    calls = 2 * (3 if image_to_video else 2)
    norms = 2 * (5 if image_to_video else 4)
    return Tiny(model, torch.randn(BATCH, 4, 2, 4, 4), inputs, expect=dict(attention=calls, rope=4, rms_norm=norms))


def wan_i2v() -> Tiny:
    return wan(image_to_video=True)


def qwenimage() -> Tiny:
    _seed()
    model = diffusers.QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                                  attention_head_dim=16, num_attention_heads=2,
                                                  joint_attention_dim=16, axes_dims_rope=(8, 4, 4))
    mask = torch.ones(BATCH, 6, dtype=torch.long)
    mask[1, 4:] = 0  # the second prompt is shorter: its padding is masked out of the joint attention
    inputs = dict(encoder_hidden_states=torch.randn(BATCH, 6, 16), encoder_hidden_states_mask=mask,
                  img_shapes=[(1, 3, 4)] * BATCH)
    # joint attention per block; rope on the image and text q and k; q/k norms of both streams; the text input norm
    return Tiny(model, torch.randn(BATCH, 12, 16), inputs, expect=dict(attention=2, rope=8, rms_norm=9))


def hunyuan_video() -> Tiny:
    _seed()
    model = diffusers.HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                                     attention_head_dim=8, num_layers=1, num_single_layers=1,
                                                     num_refiner_layers=1, patch_size=1, patch_size_t=1,
                                                     guidance_embeds=False, text_embed_dim=16,
                                                     pooled_projection_dim=8, rope_axes_dim=(2, 2, 4))
    mask = torch.ones(BATCH, 5, dtype=torch.long)
    mask[0, 3:] = 0
    inputs = dict(encoder_hidden_states=torch.randn(BATCH, 5, 16), encoder_attention_mask=mask,
                  pooled_projections=torch.randn(BATCH, 8))
    # the token refiner's self-attention, the dual and the single block; rope on the video tokens' q and k
    return Tiny(model, torch.randn(BATCH, 4, 2, 2, 3), inputs, expect=dict(attention=3, rope=4, rms_norm=6))


FAMILIES = {"flux": flux, "flux2": flux2, "sd3": sd3, "sdxl_unet": sdxl_unet, "wan": wan, "wan_i2v": wan_i2v,
            "qwenimage": qwenimage, "hunyuan_video": hunyuan_video}


def noisy_batch(tiny: Tiny, seed: int = 1) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """(forward kwargs, target, per-sample loss weight) of one training step, as diffusers' scripts build them:
    logit-normal timesteps and SD3's loss weighting for flow matching; DDPM noise for epsilon prediction."""
    gen = torch.Generator().manual_seed(seed)
    latents = tiny.latents
    noise = torch.randn(latents.shape, generator=gen)
    if tiny.epsilon:
        timesteps = torch.randint(0, 1000, (BATCH,), generator=gen)
        alphas = torch.cumprod(1 - torch.linspace(1e-4, 2e-2, 1000), 0)[timesteps].view(-1, 1, 1, 1)
        noisy = alphas.sqrt() * latents + (1 - alphas).sqrt() * noise
        return {tiny.hidden: noisy, "timestep": timesteps, **tiny.inputs}, noise, torch.ones(BATCH)
    torch.manual_seed(seed)  # compute_density_for_timestep_sampling draws from the global generator
    u = compute_density_for_timestep_sampling("logit_normal", BATCH, logit_mean=0.0, logit_std=1.0)
    sigmas = u.view(-1, *([1] * (latents.dim() - 1)))
    noisy = (1 - sigmas) * latents + sigmas * noise
    weighting = compute_loss_weighting_for_sd3("sigma_sqrt", sigmas).reshape(BATCH, -1)[:, 0]
    return {tiny.hidden: noisy, "timestep": u * 1000, **tiny.inputs}, noise - latents, weighting


def loss_of(tiny: Tiny, batch: tuple[dict[str, Any], torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The scripts' loss: per-sample weighted MSE between the prediction and the target, averaged."""
    kwargs, target, weighting = batch
    pred = tiny.model(**kwargs, return_dict=False)[0]
    per_sample = ((pred.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean(1)
    return (weighting * per_sample).mean()


def loss_and_grads(tiny: Tiny, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    tiny.model.zero_grad(set_to_none=True)
    loss = loss_of(tiny, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in tiny.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_close_grads(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    """The same gradients, each to 1e-4 relative (1e-6 absolute: a key bias's gradient is zero in exact math)."""
    assert expected.keys() == got.keys(), set(expected) ^ set(got)
    for name, want in expected.items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
