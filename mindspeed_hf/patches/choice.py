"""On the torch backend, HF's own code wherever ours gains nothing (kernels.torch_path: auto).

The torch backend (backend: auto in a process without an NPU or a GPU, or backend: torch anywhere) runs our ops as
pure torch: HF's math, through one more layer of Python per call. Measured on CPU, one thread, in whole training
steps against plain HF (benchmarks/results/torch_path_cpu.md, docs/host_time.md), ours gains nothing for RMSNorm,
SwiGLU and the loss of a small vocabulary (the same ATen work, our call around it), and it is slower for the
interleaved rope (DeepSeek-V3's: ours lays the pairs apart first); it gains for the usual rotary embeddings and for
the chunked loss of a large vocabulary (faster, and a fraction of the memory). Attention stays ours whatever
it costs: it keeps packed documents apart where HF's sdpa does not (a forward with a cache, documents told only by
cu_seq_lens) and shares key/value heads on a padded batch where HF repeats them.

So under `auto` a single-process model (no tensor, context or expert parallelism, whose steps build on our kernels)
on the torch backend runs HF's code for the first group (the loss only where its own settings, skip_logits: always
or a loss_chunk_size, do not ask for ours): the config current while it runs (`running_config`) has
those kernels off, the choice made once per model from its config, and report()["hf_path"] says which and why.
`fused` runs ours everywhere (the reference the device kernels are checked against, what the test suite runs). The
device backends always run ours.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from ..config import MindSpeedConfig
from ..device import detect_device_type

# The loss of a vocabulary up to this size runs HF's head and cross-entropy on the torch backend: its logits are
# small ([tokens, vocabulary] fp32) and the chunked op's fixed cost is not repaid (measured below it; above it the
# chunked loss is as fast or faster, docs/host_time.md).
SMALL_VOCAB = 4096

#: op -> why HF's code runs it on the torch backend under kernels.torch_path: auto
REASONS = {
    "rms_norm": "HF's RMSNorm: on the torch backend ours is the same math with one more call (no gain)",
    "swiglu": "HF's MLP: on the torch backend ours is the same math with one more call (no gain)",
    "fused_linear_cross_entropy": f"HF's loss: a vocabulary of at most {SMALL_VOCAB} keeps the logits small, and the "
                                  "chunked loss's fixed cost is not repaid on the torch backend (no gain)",
    "rope": "HF's interleaved rope (config.rope_interleave): ours lays the pairs apart first, a copy that HF's turn "
            "in place does without (slower on the torch backend)",
}


def candidates(model_config: Any) -> frozenset[str]:
    """The ops for which ours gains nothing over HF's code (or is slower) on the torch backend, for a model of
    `model_config` (its text model's vocabulary decides the loss, its rope_interleave the rope)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    ops = {"rms_norm", "swiglu"}
    if getattr(text, "rope_interleave", False):  # DeepSeek-V3's apply_rotary_pos_emb_interleave
        ops.add("rope")
    vocab = getattr(text, "vocab_size", None)
    if isinstance(vocab, int) and vocab <= SMALL_VOCAB:
        ops.add("fused_linear_cross_entropy")
    return frozenset(ops)


@functools.cache
def _process_device_type() -> str:
    return detect_device_type()


def _single_process(config: MindSpeedConfig) -> bool:
    """No tensor, context or expert parallelism: their steps (vocab-parallel loss, sequence-parallel norms, split
    batches) are built on our kernels."""
    return config.parallel.tp == config.parallel.cp == config.parallel.ep == 1


def _asked_for(config: MindSpeedConfig, op: str) -> bool:
    """The config's own settings of `op` ask for our kernel: the fused loss where the logits are skipped always or
    its chunk size is set."""
    kernels = config.kernels
    return op == "fused_linear_cross_entropy" and (kernels.skip_logits == "always" or kernels.loss_chunk_size > 0)


def on_torch_backend(config: MindSpeedConfig) -> bool:
    """Whether models under `config` run the torch backend: backend torch, or auto in a process with no NPU or GPU
    (a model is trained on the process's accelerator where it has one)."""
    return config.backend == "torch" or (config.backend == "auto" and _process_device_type() == "cpu")


_RUNNING: dict[tuple[int, frozenset[str]], tuple[MindSpeedConfig, MindSpeedConfig]] = {}


def running_config(config: MindSpeedConfig, ops: frozenset[str]) -> MindSpeedConfig:
    """The config current while a model runs: `config`, with the kernels of `ops` (the model's candidates) off
    where HF's code runs them instead (kernels.torch_path: auto, a single-process model on the torch backend). Made
    once per (config, candidates); `config` itself when nothing changes."""
    key = (id(config), ops)
    hit = _RUNNING.get(key)
    if hit is not None and hit[0] is config:
        return hit[1]
    chooses = config.kernels.torch_path == "auto" and _single_process(config) and on_torch_backend(config)
    off = [op for op in sorted(ops) if getattr(config.kernels, op) and not _asked_for(config, op)] if chooses else []
    running = dataclasses.replace(config, kernels=dataclasses.replace(config.kernels, **dict.fromkeys(off, False))) \
        if off else config
    _RUNNING[key] = (config, running)
    return running


def hf_path(config: MindSpeedConfig, running: MindSpeedConfig) -> dict[str, str]:
    """op -> why HF's code runs it: the kernels `config` asks for that its running config hands to HF."""
    return {op: reason for op, reason in REASONS.items()
            if getattr(config.kernels, op) and not getattr(running.kernels, op)}
