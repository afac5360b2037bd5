"""A strict CPU stand-in for torch_npu's fused ops (torch-npu 2.14.0 schemas), for testing NPU code paths.

Put tests/npu_standin on sys.path and `import torch_npu`: every op follows the real schema (names, order,
defaults), computes the reference math in plain torch, and raises where the device op raises (mask polarity and
shape, dtypes, layouts, varlen offsets, limits). Inputs the real op accepts but this stand-in does not model raise
NotImplementedError. It does not create torch.npu.
"""

from . import npu
from .activation import npu_swiglu
from .attention import npu_fusion_attention, npu_fusion_attention_grad
from .gmm import npu_grouped_matmul
from .loss import npu_cross_entropy_loss
from .moe import npu_moe_gating_top_k_softmax, npu_moe_init_routing, npu_moe_token_permute, npu_moe_token_unpermute
from .norm import npu_add_rms_norm, npu_rms_norm, npu_rms_norm_backward
from .rotary import npu_rotary_mul

__version__ = "2.14.0"

__all__ = [
    "npu",
    "npu_add_rms_norm",
    "npu_cross_entropy_loss",
    "npu_fusion_attention",
    "npu_fusion_attention_grad",
    "npu_grouped_matmul",
    "npu_moe_gating_top_k_softmax",
    "npu_moe_init_routing",
    "npu_moe_token_permute",
    "npu_moe_token_unpermute",
    "npu_rms_norm",
    "npu_rms_norm_backward",
    "npu_rotary_mul",
    "npu_swiglu",
]
