"""MindSpeedTrainingArguments: TrainingArguments plus typed fields for the accelerator.

Every field is a dataclass field with help text, so HfArgumentParser turns them into CLI flags
(`--mindspeed_rope false`, `--mindspeed_recompute`) and reads them from YAML/JSON like any HF argument class.
The accelerator config is built and validated in __post_init__, so a bad value fails before any model is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from ..config import MindSpeedConfig, load_config
from ..ops.registry import BACKEND_CHOICES

# Field name on the arguments -> (config section, key). The order is the order of the config dataclasses.
_FIELD_TO_CONFIG: dict[str, tuple[str | None, str]] = {
    "mindspeed_backend": (None, "backend"),
    "mindspeed_rms_norm": ("kernels", "rms_norm"),
    "mindspeed_rope": ("kernels", "rope"),
    "mindspeed_swiglu": ("kernels", "swiglu"),
    "mindspeed_attention": ("kernels", "attention"),
    "mindspeed_fused_linear_cross_entropy": ("kernels", "fused_linear_cross_entropy"),
    "mindspeed_loss_chunk_size": ("kernels", "loss_chunk_size"),
    "mindspeed_dp_replicate": ("parallel", "dp_replicate"),
    "mindspeed_dp_shard": ("parallel", "dp_shard"),
    "mindspeed_cp": ("parallel", "cp"),
    "mindspeed_ep": ("parallel", "ep"),
    "mindspeed_reshard_after_forward": ("parallel", "reshard_after_forward"),
    "mindspeed_cpu_offload": ("parallel", "cpu_offload"),
    "mindspeed_prefetch": ("parallel", "prefetch"),
    "mindspeed_recompute": ("memory", "recompute"),
}


def _kernel_help(op: str) -> dict[str, Any]:
    return {"help": f"mindspeed_hf: use the fused {op} kernel (false keeps the model's own code for it)."}


@dataclass
class MindSpeedTrainingArguments(TrainingArguments):
    """TrainingArguments with the mindspeed_hf accelerator settings (kernels, parallel sizes, memory)."""

    mindspeed_backend: str = field(
        default="auto",
        metadata={
            "help": "mindspeed_hf kernel backend: auto follows the tensors' device; torch, npu or cuda force one. "
            "MINDSPEED_HF_BACKEND overrides it.",
            "choices": list(BACKEND_CHOICES),
        },
    )
    mindspeed_rms_norm: bool = field(default=True, metadata=_kernel_help("RMSNorm"))
    mindspeed_rope: bool = field(default=True, metadata=_kernel_help("rotary position embedding"))
    mindspeed_swiglu: bool = field(default=True, metadata=_kernel_help("SwiGLU MLP"))
    mindspeed_attention: bool = field(default=True, metadata=_kernel_help("attention"))
    mindspeed_fused_linear_cross_entropy: bool = field(
        default=True,
        metadata={"help": "mindspeed_hf: chunked causal-LM loss that never holds the full [tokens, vocab] logits."},
    )
    mindspeed_loss_chunk_size: int = field(
        default=0, metadata={"help": "mindspeed_hf: tokens per chunk of the fused loss; 0 picks one automatically."}
    )
    mindspeed_dp_replicate: int = field(
        default=1, metadata={"help": "mindspeed_hf: data-parallel replicas (HSDP outer dimension)."}
    )
    mindspeed_dp_shard: int = field(
        default=-1, metadata={"help": "mindspeed_hf: FSDP2 shard group size; -1 takes what the other sizes leave."}
    )
    mindspeed_cp: int = field(default=1, metadata={"help": "mindspeed_hf: context-parallel size."})
    mindspeed_ep: int = field(default=1, metadata={"help": "mindspeed_hf: expert-parallel size (MoE models)."})
    mindspeed_reshard_after_forward: bool = field(
        default=True, metadata={"help": "mindspeed_hf: FSDP2 frees gathered parameters after each forward."}
    )
    mindspeed_cpu_offload: bool = field(
        default=False, metadata={"help": "mindspeed_hf: FSDP2 keeps sharded parameters in host memory."}
    )
    mindspeed_prefetch: int = field(
        default=1, metadata={"help": "mindspeed_hf: FSDP2 layers whose parameters are gathered ahead."}
    )
    mindspeed_recompute: bool = field(
        default=False,
        metadata={"help": "mindspeed_hf: recompute activations in backward (non-reentrant activation checkpointing)."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        # Validate now: a bad value must fail when the arguments are parsed, not after the model is built.
        self.mindspeed_config()

    def mindspeed_config_dict(self) -> dict[str, Any]:
        """The accelerator settings of these arguments as a nested config dict (see mindspeed_hf.config)."""
        data: dict[str, Any] = {"kernels": {}, "parallel": {}, "memory": {}}
        for name, (section, key) in _FIELD_TO_CONFIG.items():
            value = getattr(self, name)
            if section is None:
                data[key] = value.lower() if isinstance(value, str) else value
            else:
                data[section][key] = value
        return data

    def mindspeed_config(self) -> MindSpeedConfig:
        """Build and validate the MindSpeedConfig these arguments describe (MINDSPEED_HF_BACKEND still wins)."""
        try:
            return load_config(self.mindspeed_config_dict())
        except ValueError as err:
            # Name the argument the user actually set, not only the config key behind it.
            raise ValueError(f"invalid mindspeed_* training argument: {err}") from err

    @classmethod
    def config_fields(cls) -> dict[str, tuple[str | None, str]]:
        """Map of argument name -> (config section or None for top level, config key)."""
        return dict(_FIELD_TO_CONFIG)

    @classmethod
    def fields_from_config(cls, config: MindSpeedConfig) -> dict[str, Any]:
        """The mindspeed_* keyword arguments that reproduce `config` (used by the CLI's YAML runs)."""
        out: dict[str, Any] = {}
        for name, (section, key) in _FIELD_TO_CONFIG.items():
            out[name] = getattr(config if section is None else getattr(config, section), key)
        return out
