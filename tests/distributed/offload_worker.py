"""torchrun worker for test_offload_fsdp.py (2 ranks, gloo on CPU). Rank 0 writes a JSON report to --out.

recompute_worker's comparison (a tiny Qwen3, plain and with LoRA; one training step under FSDP2, reshard after
forward, against the same sharded step without any memory setting and against one process) with activation offload
alone, with selective and with full recompute, plus the offloader's counters and the layers' classes.
"""

from __future__ import annotations

from recompute_worker import all_ranks, main

from mindspeed_hf.memory import is_offload_layer, offloader_of
from mindspeed_hf.memory.recompute import decoder_layers

OFFLOAD = {"offload_activations": True, "offload_min_bytes": 0}
SETTINGS = {"offload": OFFLOAD, "offload+selective": {**OFFLOAD, "recompute": "selective"},
            "offload+full": {**OFFLOAD, "recompute": "full"}}


def offload_facts(model) -> dict:
    offloader = offloader_of(model)
    layers = decoder_layers(model)
    return {"peak_offloaded_bytes": offloader.peak_offloaded_bytes,
            "nothing_left_all_ranks": all_ranks(offloader.live_entries() == 0 and offloader.offloaded_bytes == 0),
            "layer_classes": sorted({type(m).__name__ for m in layers}),
            "offload_layers": all(is_offload_layer(m) for m in layers)}


if __name__ == "__main__":
    main(SETTINGS, offload_facts)
