"""device.Transfers (streams, events, host buffers for offload) and the host-buffer pool."""

from __future__ import annotations

import pytest
import torch

from mindspeed_hf.device import HostEvent, HostStream, transfers
from mindspeed_hf.memory.host_pool import HostBufferPool


def test_cpu_transfers_are_stand_ins_with_real_host_buffers():
    ways = transfers("cpu")
    assert not ways.asynchronous and transfers("cpu") is ways
    assert isinstance(ways.side_stream(), HostStream) and ways.side_stream() is ways.side_stream()
    event = ways.event()
    assert isinstance(event, HostEvent) and event.query()
    buffer = ways.host_buffer(64)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 64 and not buffer.is_pinned()
    with ways.on(ways.side_stream()):
        buffer.copy_(torch.arange(64, dtype=torch.uint8))
    assert buffer[-1] == 63


def test_unknown_device_type_is_one_line():
    with pytest.raises(ValueError, match="unsupported device type 'xpu'; valid choices: npu, cuda, cpu"):
        transfers("xpu")


def test_pool_hands_back_the_same_buffers():
    pool = HostBufferPool(transfers("cpu"))
    a, b = pool.get(128), pool.get(256)
    assert (pool.allocated, pool.reused, pool.held_bytes) == (2, 0, 384)
    pool.put(a)
    pool.put(b)
    again = {pool.get(256).data_ptr(), pool.get(128).data_ptr()}
    assert again == {a.data_ptr(), b.data_ptr()} and (pool.allocated, pool.reused) == (2, 2)
    assert pool.get(128).data_ptr() != a.data_ptr() and pool.allocated == 3  # a is still out
    pool.put(a)
    pool.clear()
    assert pool.free_buffers() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (real side stream, pinned memory)")
def test_cuda_offload_overlaps_and_lowers_the_peak():
    from tiny_models import tiny_model

    import mindspeed_hf
    from mindspeed_hf.config import config_from_dict
    from mindspeed_hf.memory import offloader_of
    from mindspeed_hf.parallel.parallelize import parallelize

    def step(memory):
        model = tiny_model("qwen3", num_hidden_layers=4, hidden_size=256, intermediate_size=1024).cuda().train()
        config = config_from_dict({"memory": memory})
        mindspeed_hf.enable()
        mindspeed_hf.apply_to_model(model, config)
        model = parallelize(model, None, config)
        ids = torch.randint(1, 128, (4, 512), generator=torch.Generator().manual_seed(0)).cuda()
        model(input_ids=ids, labels=ids).loss.backward()  # warm-up
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return loss.detach(), grads, torch.cuda.max_memory_allocated() - before, model

    loss, grads, peak, _ = step({})
    loss_off, grads_off, peak_off, model = step({"offload_activations": True, "offload_min_bytes": 0})
    torch.testing.assert_close(loss_off, loss, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_off[name], grad, atol=1e-5, rtol=1e-5)
    offloader = offloader_of(model)
    (pool,) = offloader.pools.values()
    assert offloader.peak_offloaded_bytes > 0 and offloader.live_entries() == 0 and pool.reused > 0
    assert peak_off < peak
