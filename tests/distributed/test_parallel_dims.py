"""ParallelDims validation and shard-slice arithmetic (no process group needed)."""

from __future__ import annotations

import os

os.environ.setdefault("MINDSPEED_HF_AUTO", "0")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.distributed.tensor import Replicate, Shard  # noqa: E402

from mindspeed_hf.device import dist_backend  # noqa: E402
from mindspeed_hf.parallel.dims import ParallelDims  # noqa: E402
from mindspeed_hf.parallel.loading import local_shard_slices  # noqa: E402


def test_fill_in_and_properties():
    d = ParallelDims(world_size=8)
    assert (d.dp_replicate, d.dp_shard, d.cp, d.ep) == (1, 8, 1, 1)
    assert d.fsdp_enabled and not d.hsdp and not d.cp_enabled and not d.ep_enabled
    assert d.dp_size == 8 and d.fsdp_size == 8

    d = ParallelDims(dp_replicate=2, cp=2, ep=2, world_size=8)
    assert d.dp_shard == 2 and d.fsdp_size == 4 and d.dp_size == 4
    assert d.hsdp and d.cp_enabled and d.ep_enabled

    d = ParallelDims(dp_replicate=4, world_size=4)  # pure replication (DDP-like)
    assert d.dp_shard == 1 and not d.fsdp_enabled and not d.hsdp

    d = ParallelDims(world_size=1)
    assert d.dp_shard == 1 and not d.fsdp_enabled


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(dp_replicate=3, world_size=8), ["dp_replicate * cp", "3", "world_size=8", "[1, 2, 4, 8]"]),
        (dict(dp_shard=3, world_size=8), ["1 * 3 * 1 = 3", "world_size=8", "dp_shard=-1"]),
        (dict(dp_shard=2, cp=2, ep=3, world_size=4), ["ep=3", "2 * 2 = 4", "[1, 2, 4]"]),
        (dict(cp=0, world_size=4), ["cp must be", "cp=0", "[1, 2, 4]"]),
        (dict(ep=-2, world_size=4), ["ep must be", "ep=-2"]),
        (dict(dp_shard=0, world_size=4), ["dp_shard", "dp_shard=0"]),
        (dict(world_size=0), ["world_size", "0"]),
        (dict(dp_replicate=2, dp_shard=2, cp=2, world_size=4), ["2 * 2 * 2 = 8", "world_size=4"]),
        (dict(dp_shard=2, tp=2, world_size=2), ["dp_replicate * dp_shard * cp * tp = 1 * 2 * 1 * 2 = 4",
                                                "world_size=2"]),
        (dict(dp_replicate=3, tp=2, world_size=8), ["dp_replicate * cp * tp = 3 * 1 * 2 = 6", "world_size=8"]),
        (dict(tp=0, world_size=4), ["tp must be", "tp=0", "[1, 2, 4]"]),
        # not supported together yet: one line, before any mesh
        (dict(tp=2, cp=2, world_size=4), ["tp=2 with cp=2", "not supported yet", "valid choices: tp=1 or cp=1"]),
        (dict(tp=2, ep=2, world_size=4), ["tp=2 with ep=2", "not supported yet", "valid choices: tp=1 or ep=1"]),
    ],
)
def test_invalid_sizes_name_sizes_and_choices(kwargs, words):
    with pytest.raises(ValueError) as err:
        ParallelDims(**kwargs)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_tp_axis_fills_and_names_the_world_mesh():
    from mindspeed_hf.config import AXES
    from mindspeed_hf.parallel.dims import MESH_DIM_NAMES

    d = ParallelDims(tp=2, world_size=8)  # dp_shard takes what tp leaves
    assert (d.dp_replicate, d.dp_shard, d.cp, d.tp) == (1, 4, 1, 2)
    assert d.tp_enabled and d.dp_size == 4 and d.fsdp_size == 4 and d.same_batch_size == 2
    d = ParallelDims(dp_replicate=2, tp=2, world_size=4)
    assert d.dp_shard == 1 and not d.fsdp_enabled and d.dp_size == 2
    # the world mesh's dims are the rows of AXES that are world axes, outermost first: tp innermost
    assert MESH_DIM_NAMES == tuple(a.mesh for a in AXES if a.world) == ("dp_replicate", "dp_shard", "cp", "tp")
    assert "\n" not in str(pytest.raises(ValueError, ParallelDims, tp=2, cp=2, world_size=4).value)


def test_backend_map():
    assert dist_backend("cpu") == "gloo"
    assert dist_backend("cuda") == "nccl"
    assert dist_backend("npu") == "hccl"
    with pytest.raises(ValueError, match="valid choices"):
        dist_backend("tpu")


def test_mesh_helpers_need_a_built_mesh():
    d = ParallelDims(world_size=2)
    with pytest.raises(RuntimeError, match="build_mesh"):
        d.world_mesh  # noqa: B018


class _FakeMesh:
    """Stands in for a DeviceMesh: sizes per dim and this rank's coordinate."""

    def __init__(self, sizes, coord):
        self._sizes, self._coord = sizes, coord

    def size(self, dim):
        return self._sizes[dim]

    def get_coordinate(self):
        return list(self._coord)


@pytest.mark.parametrize("rows, world", [(5, 2), (5, 4), (131, 2), (7, 3), (2, 4), (0, 2)])
def test_local_shard_slices_follow_torch_chunk(rows, world):
    t = torch.arange(rows * 3).reshape(rows, 3)
    chunks = list(torch.chunk(t, world, dim=0)) if rows else []
    for r in range(world):
        expected = chunks[r] if r < len(chunks) else t[rows:]
        got = t[local_shard_slices(t.shape, _FakeMesh([world], [r]), [Shard(0)])]
        assert torch.equal(got, expected), (rows, world, r)


def test_local_shard_slices_hsdp():
    t = torch.arange(10 * 2).reshape(10, 2)
    for rep in range(2):
        for r in range(2):
            mesh = _FakeMesh([2, 2], [rep, r])
            got = t[local_shard_slices(t.shape, mesh, [Replicate(), Shard(0)])]
            assert torch.equal(got, torch.chunk(t, 2)[r])


def _run_to_exit(tmp_path, body: str):
    """Run `body` in a fresh interpreter (no torchrun variables) after an atexit hook that reports, after ours,
    whether the default group is still up; returns the finished process."""
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(
        "import atexit, os, torch, torch.distributed as dist\n"
        "from mindspeed_hf.parallel.dims import _free_port, _gloo_worker_states, init_distributed\n"
        "atexit.register(lambda: print('initialized at the end:', dist.is_initialized()))  # runs after ours\n"
        + body)
    env = {**os.environ, "MINDSPEED_HF_AUTO": "0"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_process_group_is_shut_down_at_exit(tmp_path):
    """init_distributed registers a clean shutdown: the group is destroyed and the gloo worker threads (found
    by name, so a torch rename would show here) are idle before the interpreter finalises."""
    proc = _run_to_exit(tmp_path, "init_distributed('cpu')\n"
                                  "dist.all_reduce(torch.ones(3))\n"
                                  "print('workers:', sorted(set(_gloo_worker_states())) or 'none')\n")
    assert "workers: none" not in proc.stdout and "workers: [" in proc.stdout, proc.stdout
    assert "initialized at the end: False" in proc.stdout, proc.stdout


def test_a_group_we_did_not_create_is_left_alone_at_exit(tmp_path):
    """A process group the script (or accelerate) started is not destroyed by our exit hook; the gloo workers are
    still waited for."""
    proc = _run_to_exit(tmp_path, "os.environ.update(RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1', "
                                  "MASTER_PORT=str(_free_port()))\n"
                                  "dist.init_process_group('gloo')\n"
                                  "init_distributed('cpu')\n"
                                  "dist.all_reduce(torch.ones(3))\n")
    assert "initialized at the end: True" in proc.stdout, proc.stdout


def test_enable_registers_the_exit_wait_for_groups_started_without_us(monkeypatch):
    """Trainer's DDP and DeepSpeed start their gloo groups themselves (no init_distributed): enable() registers the
    exit wait for idle gloo workers all the same (a worker left dropping a collective's tensors during finalisation
    aborted finished DDP and DeepSpeed ranks in CI)."""
    import mindspeed_hf
    from mindspeed_hf.parallel import dims

    registered = []
    monkeypatch.setattr(dims.atexit, "register", registered.append)
    dims.quiesce_gloo_at_exit.cache_clear()
    was_enabled = mindspeed_hf.is_enabled()
    try:
        mindspeed_hf.enable()
    finally:
        if not was_enabled:
            mindspeed_hf.disable()
    assert dims._wait_for_idle_gloo_workers in registered, registered
