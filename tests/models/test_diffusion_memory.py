"""Selective recompute and activation offload per transformer block of diffusers denoisers (memory.recompute full
/ selective, memory.offload_activations), applied by parallelize's memory steps on top of the npu kernels: the loss
and every gradient equal plain diffusers; the chosen blocks (or their attention / feed-forward / norm parts) really
run again in backward, with the fused kernels again (their scope is current in the replay); offload really moves
what the blocks save."""

import pytest
import torch
from tiny_denoisers import FAMILIES, assert_close_grads, loss_and_grads, noisy_batch

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.memory import offloader_of
from mindspeed_hf.memory.recompute import decoder_layers
from mindspeed_hf.parallel.parallelize import parallelize
from mindspeed_hf.patches.diffusion import DENOISERS

OFFLOAD = {"offload_activations": True, "offload_min_bytes": 0}
MODES = {
    "full": {"recompute": "full"},
    "full_some_blocks": {"recompute": "full", "recompute_layers": [0]},
    "selective": {"recompute": "selective", "recompute_modules": ["attention_core", "mlp", "norms"]},
    "offload": OFFLOAD,
    "offload+full": {**OFFLOAD, "recompute": "full"},
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_blocks_found(name):
    """The units recompute, offload and FSDP2 work on: each family's transformer blocks, in order."""
    model = FAMILIES[name]().model
    names = DENOISERS[name.removesuffix("_i2v")].blocks
    blocks = decoder_layers(model)
    assert blocks == [m for m in model.modules() if type(m).__name__ in names] and blocks


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_memory_modes_equal_plain(name):
    tiny = FAMILIES[name]()
    batch = noisy_batch(tiny)
    expected = loss_and_grads(tiny, batch)
    blocks = decoder_layers(tiny.model)
    state = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    for mode, memory in MODES.items():
        fresh = FAMILIES[name]()
        fresh.model.load_state_dict(state)
        config = config_from_dict({"backend": "npu", "memory": memory})
        mindspeed_hf.enable(config)
        mindspeed_hf.apply_to_model(fresh.model, config)
        parallelize(fresh.model, None, config)
        offloader = offloader_of(fresh.model)
        if offloader is not None:
            offloader.trace = []
        loss, grads = loss_and_grads(fresh, batch)
        torch.testing.assert_close(loss, expected[0], atol=1e-5, rtol=1e-5, msg=mode)
        assert_close_grads(expected[1], grads)
        # the fused attention ran again in backward for every attention layer of the recomputed blocks
        chosen = blocks[:1] if mode == "full_some_blocks" else blocks if "recompute" in memory else []
        again = sum(hasattr(m, "processor") for b in chosen for m in b.modules())
        assert mindspeed_hf.report(fresh.model)["ran"]["attention"] == tiny.expect["attention"] + again, mode
        if offloader is not None:  # block 0's saved tensors went to the host (with full recompute only its
            # inputs are saved, which the model holds anyway), and nothing is left after backward
            assert ("pack", 0) in offloader.trace or mode == "offload+full"
            assert ("load", 0) in offloader.trace and offloader.live_entries() == 0
        mindspeed_hf.disable()
