"""diffusers' image and video denoisers (Flux, Flux.2, SD3, SDXL's UNet, Wan 2.x, Qwen-Image, HunyuanVideo) as
declarative family entries (families.py): attention, rope, q/k RMSNorm and SwiGLU sites (sites.py, wan.py), and
the models settled, reported and released (model.py)."""

from .families import DENOISERS, DenoiserFamily
from .model import apply_to_model, block_parts, denoiser_blocks, family_of, find_denoiser, release, report, watch

__all__ = ["DENOISERS", "DenoiserFamily", "apply_to_model", "block_parts", "denoiser_blocks", "family_of",
           "find_denoiser", "release", "report", "watch"]
