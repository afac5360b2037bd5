"""The accelerator's settings, declared once: one dataclass per group (kernels, parallel, memory), each field with
its default, its value kind (mindspeed_hf.value_kinds) and its help text.

Everything else is derived from these declarations: the YAML schema (sections `kernels` / `parallel` / `memory` /
`moe` / `checkpoints` / `data` plus `backend`), the training arguments (`mindspeed_<key>`), the environment variables
(`MINDSPEED_HF_<SECTION>_<KEY>`, `MINDSPEED_HF_BACKEND`) and the one validation: every value goes through its kind,
whichever source gave it, when a config is built (`__post_init__`), and a config builds only if it is valid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..releases.supported import check_ep_release
from ..value_kinds import (
    Kind,
    boolean,
    choice,
    choice_list,
    choice_or_bool,
    flag,
    integer,
    known_keys,
    layer_selection,
    non_negative_int,
    positive_number,
)

# Kernel backends (ops.registry dispatches on them). Declared here, with the settings, so that reading a config
# imports no torch: `mindspeed-hf --help` and config errors stay fast.
BACKEND_CHOICES = ("auto", "torch", "npu", "cuda")
# kernels.torch_path: what runs on the torch backend (patches/choice.py)
TORCH_PATHS = ("auto", "fused")

ENV_PREFIX = "MINDSPEED_HF_"

# What `mindspeed-hf train --recipe NAME` runs when no run YAML is given; the first is the default.
TRAIN_RECIPES = {
    "text": "the embedded text run (a tiny Qwen3 model learns list operations), or the run a CONFIG.yaml describes",
    "vl": "the embedded vision-language run: a tiny Qwen2.5-VL model learns to answer questions about synthetic "
          "images (the colour and the quadrant of a shape); needs transformers >= 5",
    "omni": "the embedded audio + vision + text run: a tiny Qwen2.5-Omni thinker learns to answer questions about "
            "a synthetic audio clip (the pitch and the length of a tone) and a synthetic image",
    "diffusion": "the embedded text-to-image LoRA run: a tiny Flux transformer (diffusers) learns the latent pattern "
                 "of each of four prompts with diffusers' flow-matching LoRA loop; needs diffusers (the diffusion "
                 "extra)",
}


def _declare(default: Any, kind: Kind, text: str) -> Any:
    """One setting: its default, its value kind and its help (a dataclass field; a list default is copied)."""
    metadata = {"help": text, "kind": kind}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _check_fields(values: Any, section: str | None) -> None:
    """Every declared field of `values` through its kind, replaced by its canonical value; errors name
    `section.key` (`key` at the top level)."""
    for f in dataclasses.fields(values):
        if "kind" in f.metadata:
            where = f"{section}.{f.name}" if section else f.name
            setattr(values, f.name, f.metadata["kind"].check(where, getattr(values, f.name)))


@dataclass
class KernelConfig:
    """Which fused kernels to apply. Each one can be switched off on its own."""

    rms_norm: bool = _declare(True, boolean(), "use the fused RMSNorm kernel")
    rope: bool = _declare(True, boolean(), "use the fused rotary position embedding kernel")
    swiglu: bool = _declare(True, boolean(), "use the fused SwiGLU MLP kernel")
    attention: bool = _declare(True, boolean(), "make the fused attention kernel the default attention (an "
                                                "explicit attn_implementation is kept)")
    take_flash_attention: bool = _declare(False, boolean(), "an explicit attn_implementation flash_attention_2 / "
                                          "flash_attention_3 runs the fused attention instead (packed rows kept apart "
                                          "by their position ids or cu_seq_lens on every backend): for frameworks "
                                          "that pack only under a flash name (ms-swift --padding_free / --packing "
                                          "with --attn_impl flash_attn)")
    fused_linear_cross_entropy: bool = _declare(True, boolean(), "chunked causal-LM loss that never holds the full "
                                                                 "[tokens, vocab] logits")
    experts: bool = _declare(True, boolean(), "make the grouped-GEMM MoE experts kernel the default experts "
                             "implementation (transformers >= 5; an explicit experts_implementation is kept)")
    linear_attention: bool = _declare(True, boolean(), "Gated DeltaNet layers (Qwen3-Next, Qwen3.5): the chunked "
                                      "gated delta rule on the backend's kernel (flash-linear-attention on CUDA/NPU "
                                      "when installed, transformers' torch code otherwise) and packed documents kept "
                                      "apart in the linear layers as in the attention ones")
    torch_path: str = _declare("auto", choice(TORCH_PATHS), "on the torch backend (a process without an NPU or "
                               "GPU, or backend: torch): auto runs HF's own code for each op where ours measured "
                               "no faster there (RMSNorm, SwiGLU, the loss of a vocabulary up to 4096 unless "
                               "skip_logits: always or loss_chunk_size asks for it, an interleaved rope) in a model "
                               "without tp / cp / ep; report()['hf_path'] names them. fused runs ours everywhere (the "
                               "reference the device kernels are checked against). Device backends are not affected")
    loss_chunk_size: int = _declare(0, integer(0, " (0 = automatic)"), "tokens per chunk of the fused loss; 0 picks "
                                                                       "one from the vocabulary size")
    skip_logits: str = _declare("auto", choice(("auto", "always", "never")), "when a forward with labels builds the "
                                "logits: auto (skipped in Trainer's own loss computation, made on first read "
                                "elsewhere), always (skipped in every training forward with labels; reading .logits "
                                "then raises), never (always built, HF's loss)")

    def __post_init__(self) -> None:
        _check_fields(self, "kernels")


@dataclass
class ParallelConfig:
    """Device-mesh sizes and FSDP2 knobs. dp_shard=-1 takes what the other sizes leave of the world size. The sizes
    are the axes of config/axes.py (AXES), which derives every other name of them."""

    dp_replicate: int = _declare(1, integer(1), "data-parallel replicas (HSDP outer dimension)")
    dp_shard: int = _declare(-1, integer(1, ", or -1 to fill the world size", also=-1), "FSDP2 shard group size; -1 "
                             "takes what the other sizes leave of the world size")
    cp: int = _declare(1, integer(1), "context-parallel size: each sequence is split across cp ranks (which also "
                       "shard the parameters with dp_shard); cp = ring size x cp_ulysses")
    ep: int = _declare(1, integer(1), "expert-parallel size for MoE models with fused experts (transformers >= 5): "
                       "each expert lives on one of ep ranks, borrowed from dp_shard * cp (must divide it and the "
                       "number of experts)")
    tp: int = _declare(1, integer(1), "tensor-parallel size: each projection's weight is split across tp ranks "
                       "(column / row parallel from the family's base_model_tp_plan, sequence parallel norms); the "
                       "world is dp_replicate x dp_shard x cp x tp, FSDP2 shards over the data-parallel ranks only; "
                       "needs untied embeddings, not yet with cp, ep or DeepSpeed")
    cp_ulysses: int = _declare(1, integer(1), "Ulysses (all-to-all heads <-> sequence) ranks inside the cp group; the "
                               "rest (cp / cp_ulysses) form the ring; must divide cp and the attention heads")
    cp_zigzag: bool = _declare(True, boolean(), "context parallelism cuts each ring rank's share into two chunks "
                               "(head and tail) that balance causal work")
    cp_vision: bool = _declare(False, boolean(), "vision-language models under cp: each cp rank runs the vision "
                               "tower on its share of the images (whole images, balanced by patches) and the merged "
                               "features are gathered, instead of every rank running it on all of them")
    reshard_after_forward: bool = _declare(True, boolean(), "FSDP2 frees the gathered parameters of a layer after "
                                                            "its forward")
    cpu_offload: bool = _declare(False, boolean(), "FSDP2 keeps sharded parameters in host memory")
    prefetch: int = _declare(1, integer(0), "FSDP2 layers whose parameters are gathered ahead")
    collective_timeout: int = _declare(600, integer(0, " (0 = off)"), "seconds the ranks of a multi-process run "
                                       "may all wait on a rank that stopped answering (it joins no collective while "
                                       "the others wait in one, or its process is gone) before the job ends with "
                                       "one line naming that rank and the step; 0: only the process group's own "
                                       "timeout (TrainingArguments.ddp_timeout)")

    def __post_init__(self) -> None:
        _check_fields(self, "parallel")
        if self.cp % self.cp_ulysses:
            raise ValueError(f"parallel.cp_ulysses={self.cp_ulysses} must divide parallel.cp={self.cp}; valid "
                             f"choices: {[u for u in range(1, self.cp + 1) if self.cp % u == 0]}")
        if self.cp_vision and self.cp == 1:
            raise ValueError("parallel.cp_vision=true shares the vision tower over the cp ranks and needs "
                             "parallel.cp > 1; valid choices: parallel.cp > 1, or parallel.cp_vision=false")
        if self.ep > 1:
            check_ep_release(self.ep)


RECOMPUTE_MODULES = ("attention_core", "self_attn", "mlp", "norms")


@dataclass
class MemoryConfig:
    """Memory features, one switch each. `recompute` holds False (off), True (full; `full` reads back as True,
    which it has always meant) or "selective"; `recompute_mode` names the three."""

    recompute: bool | str = _declare(False, choice_or_bool(("full", "selective"), true_means="full"), "recompute "
                                     "activations in backward (non-reentrant activation checkpointing): false; full "
                                     "(whole decoder layers; true means full); selective (only the parts of each "
                                     "layer in recompute_modules)")
    recompute_modules: list[str] = _declare(["attention_core", "mlp"], choice_list(RECOMPUTE_MODULES), "what "
                                            "selective recompute reruns in each chosen decoder layer: attention_core "
                                            "(self-attention except its projection matmuls, whose outputs are kept), "
                                            "self_attn (the whole self-attention), mlp (the MLP or MoE block), norms "
                                            "(the layer's RMSNorms)")
    recompute_layers: str | int | list[int] = _declare("all", layer_selection(), "which decoder layers recompute "
                                                       "(full or selective): all, n (every n-th: 0, n, 2n, ...) or a "
                                                       "list of layer indices ([0, 2, 5]; as text 0,2,5)")
    offload_activations: bool = _declare(False, flag(), "asynchronous activation offload: what each chosen decoder "
                                         "layer saves for backward (with recompute on, its recompute inputs) is "
                                         "copied to host memory on a side stream and its device memory freed once "
                                         "the next layer starts; backward brings it back one layer ahead. The last "
                                         "decoder layer is always kept")
    offload_layers: str | int | list[int] = _declare("all", layer_selection(), "which decoder layers offload: all, n "
                                                     "(every n-th: 0, n, 2n, ...) or a list of layer indices (the "
                                                     "last decoder layer is kept whatever this says)")
    offload_min_bytes: int = _declare(1 << 20, non_negative_int("bytes"), "smallest saved tensor that is offloaded, "
                                      "in bytes; smaller ones stay on the device")

    def __post_init__(self) -> None:
        _check_fields(self, "memory")

    @property
    def recompute_mode(self) -> str:
        """"off", "full" or "selective"."""
        return "full" if self.recompute is True else (self.recompute or "off")


@dataclass
class MoEConfig:
    """What a MoE model's training shows."""

    log_load: bool = _declare(True, boolean(), "log each MoE layer's expert load with the training loss (moe/* keys: "
                              "the busiest expert over the mean, the experts that got no token) on models with fused "
                              "experts (transformers >= 5)")
    balance: str = _declare("none", choice(("none", "aux_free")), "expert balancing without an auxiliary loss: "
                            "aux_free chooses each token's experts by router score + a per-expert bias that moves "
                            "bias_update_rate towards the mean load after every optimizer step (DeepSeek-V3's "
                            "scheme); none: HF's routing unchanged")
    bias_update_rate: float = _declare(1e-3, positive_number(), "how far each expert's bias moves per optimizer step "
                                       "under balance: aux_free (towards the layer's mean load)")

    def __post_init__(self) -> None:
        _check_fields(self, "moe")


@dataclass
class CheckpointConfig:
    """What happens to each checkpoint a Trainer run saves, besides Trainer's own writing."""

    export_hf: bool = _declare(False, boolean(), "export every saved checkpoint as a Hugging Face model directory "
                               "(`mindspeed-hf export`) to OUTPUT_DIR/hf/checkpoint-N, in a background process on "
                               "the main rank while training goes on")
    overwrite: bool = _declare(False, boolean(), "a new run (not resuming) may start in an output_dir that holds "
                               "another run's checkpoints: they are removed first; false: such a run stops before "
                               "any work, naming the ways forward")

    def __post_init__(self) -> None:
        _check_fields(self, "checkpoints")


@dataclass
class DataConfig:
    """How Trainer's training data loader forms its batches."""

    max_tokens_per_batch: int = _declare(0, integer(0, " (0 = off)"), "build each training micro-batch from whole "
                                         "rows whose tokens fit this budget (padded: rows x the longest; packed by a "
                                         "flattening collator: the sum), instead of per_device_train_batch_size rows")

    def __post_init__(self) -> None:
        _check_fields(self, "data")


@dataclass
class MindSpeedConfig:
    """The whole accelerator configuration."""

    backend: str = _declare("auto", choice(BACKEND_CHOICES, fold_case=True), "kernel backend: auto follows the "
                            "tensors' device; torch, npu or cuda force one")
    kernels: KernelConfig = field(default_factory=KernelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        _check_fields(self, None)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {"kernels": KernelConfig, "parallel": ParallelConfig, "memory": MemoryConfig,
                             "moe": MoEConfig, "checkpoints": CheckpointConfig, "data": DataConfig}


# ---------------------------------------------------------------------------------------------- the settings
@dataclass(frozen=True)
class Setting:
    """One declared setting: where it lives in the config, its value kind and the names derived from it."""

    section: str | None  # None: top level (backend)
    key: str
    kind: Kind
    default: Any
    help: str

    @property
    def type(self) -> type | Kind:
        """The training argument's type: the plain type HfArgumentParser reads its own way, else the kind."""
        return self.kind.argument or self.kind

    @property
    def choices(self) -> tuple[str, ...] | None:
        return self.kind.choices

    @property
    def parser_options(self) -> dict[str, Any]:
        """Extra argparse options of the flag (a Kind's `nargs` / `const`); empty for plain types."""
        return {} if self.kind.argument else dict(self.kind.parser_options)

    @property
    def path(self) -> str:
        """`kernels.rope`, `backend`: the name used in messages and YAML."""
        return f"{self.section}.{self.key}" if self.section else self.key

    @property
    def argument(self) -> str:
        """The MindSpeedTrainingArguments field / command-line flag name."""
        return f"mindspeed_{self.key}"

    @property
    def env(self) -> str:
        """The environment variable that sets it."""
        return ENV_PREFIX + self.path.replace(".", "_").upper()


def _setting(section: str | None, f: dataclasses.Field) -> Setting:
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return Setting(section, f.name, f.metadata["kind"], default, f.metadata["help"])


def settings() -> Iterator[Setting]:
    """Every setting, in declaration order."""
    for f in dataclasses.fields(MindSpeedConfig):
        if f.name not in SECTIONS:
            yield _setting(None, f)
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            yield _setting(section, f)


SETTINGS = {s.path: s for s in settings()}
assert len({s.argument for s in SETTINGS.values()}) == len(SETTINGS), "setting keys must be unique"


# ---------------------------------------------------------------------------------------------- nested <-> flat
def _check_keys(where: str, values: Any, valid: list[str]) -> dict[str, Any]:
    return known_keys(where, values, valid, "config key")


def flatten(data: Mapping[str, Any] | None) -> dict[str, Any]:
    """Nested config dict ({backend, kernels: {...}, ...}) -> {"kernels.rope": value, ...}, keys checked."""
    data = _check_keys("", data or {}, ["backend", *SECTIONS])
    flat: dict[str, Any] = {}
    for name, values in data.items():
        if name in SECTIONS:
            values = _check_keys(name, values if values is not None else {},
                                 [f.name for f in dataclasses.fields(SECTIONS[name])])
            flat.update({f"{name}.{k}": v for k, v in values.items()})
        else:
            flat[name] = values
    return flat


def build(flat: Mapping[str, Any]) -> MindSpeedConfig:
    """The config {setting path: value} describes (the rest defaults), every value checked by its kind."""
    sections = {name: cls(**{k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith(name + ".")})
                for name, cls in SECTIONS.items()}
    return MindSpeedConfig(**({"backend": flat["backend"]} if "backend" in flat else {}), **sections)


def config_from_dict(data: Mapping[str, Any] | None) -> MindSpeedConfig:
    """Build and validate a MindSpeedConfig from nested dicts ({backend, kernels: {...}, parallel, memory, moe,
    checkpoints})."""
    return build(flatten(data))
