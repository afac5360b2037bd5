"""Parallel sizes, the named device mesh, and process-group start-up.

``ParallelDims`` holds the data-parallel layout of a run (replicate x shard x context) plus the
expert-parallel size that borrows ranks from the sharded dimension, validates it before any process
group exists, and builds one named :class:`~torch.distributed.device_mesh.DeviceMesh`:

* real axes, outermost first: ``"dp_replicate"``, ``"dp_shard"``, ``"cp"``, ``"tp"`` (the world-mesh rows of
  mindspeed_hf.config.axes.AXES; tp innermost: the ranks of a tp group are neighbours);
* flattened views: ``"dp"`` (replicate x shard: the batch is split over these ranks),
  ``"dp_shard_cp"`` (shard x cp: what FSDP shards parameters over) and ``"dp_cp"``;
* the cp axis cut into ``"cp_ring"`` x ``"cp_ulysses"`` (Ulysses innermost: cp rank = ring rank * cp_ulysses +
  Ulysses rank, the layout parallel/context/split.py cuts sequences for);
* when ``ep > 1`` the expert mesh ``("dp_replicate", "efsdp", "ep")`` over the same ranks, ep innermost, with
  ``efsdp = dp_shard * cp / ep`` (:func:`expert_mesh`), and its views ``"ep"`` (the ranks that split the experts
  and exchange tokens) and ``"expert_fsdp"`` (what FSDP shards the experts over: ``efsdp``, or
  ``(dp_replicate, efsdp)`` under HSDP).

Every axis name always exists (an axis of size 1 costs nothing and keeps the callers' code free of
``if`` ladders); :func:`fsdp_mesh` keeps axes of size 1 out of the way by returning a 1-D mesh unless
there is a real replicate axis.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..config.axes import WORLD_AXES
from ..device import detect_device_type, dist_backend, import_torch_npu

__all__ = [
    "ParallelDims",
    "expert_mesh",
    "fsdp_mesh",
    "init_distributed",
    "quiesce_gloo_at_exit",
]

#: the world mesh's dimensions, outermost first, from the one table of axes (config/axes.py AXES)
MESH_DIM_NAMES: tuple[str, ...] = WORLD_AXES


def init_distributed(
    device_type: str | None = None,
    *,
    timeout: datetime.timedelta | None = None,
) -> torch.device:
    """Start the default process group from the torchrun environment unless one is already up.

    Picks the backend from ``device_type`` (see :func:`mindspeed_hf.device.dist_backend`), sets the current accelerator
    to ``LOCAL_RANK`` for cuda/npu, and returns this rank's device. Without torchrun variables a
    one-process group is started on localhost, so single-process runs use the same code path.
    """
    device_type = device_type or detect_device_type()
    backend = dist_backend(device_type)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "npu" and import_torch_npu() is None:  # registers torch.npu and hccl
        raise RuntimeError("device_type 'npu' needs torch_npu (and the CANN toolkit) to load")
    if device_type in ("cuda", "npu"):
        getattr(torch, device_type).set_device(local_rank)
        device = torch.device(device_type, local_rank)
    else:
        device = torch.device("cpu")
    quiesce_gloo_at_exit()
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            os.environ.setdefault("LOCAL_RANK", "0")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        kwargs = {"backend": backend}
        if timeout is not None:
            kwargs["timeout"] = timeout
        if device_type == "cuda":  # binds the NCCL communicator eagerly; hccl takes set_device
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
        _destroy_at_exit()  # only a group we created: a group someone else started is theirs to shut down
    return device


@functools.cache
def quiesce_gloo_at_exit() -> None:
    """At exit, wait (briefly, locally) until the gloo worker threads are idle, whoever created the group and
    however the run was launched (registered by init_distributed and by mindspeed_hf.enable(): Trainer's DDP and
    DeepSpeed start their groups without us). Without gloo workers the wait ends after a few polls.

    Our meshes add gloo groups, and DTensor's sharding caches keep them (and their worker threads) alive into
    interpreter finalisation. A worker drops a finished collective's tensors only after the waiter has moved on;
    starved of CPU until finalisation, it then needs the GIL and aborts the process ("terminate called without an
    active exception") after a run that succeeded. Waiting here lets it finish first; it has no collective in it,
    so it cannot hang when a peer died, and it destroys nothing.
    """
    atexit.register(_wait_for_idle_gloo_workers)


@functools.cache
def _destroy_at_exit() -> None:
    """Shut down, at exit, the default process group init_distributed started (scripts rarely call
    destroy_process_group). Registered after quiesce_gloo_at_exit, so it runs before the wait."""

    def destroy() -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(destroy)


def _gloo_worker_states() -> list[str]:
    """The scheduler state (R running/runnable, S sleeping, ...) of each gloo worker thread of this process
    (Linux /proc; empty where it cannot be read)."""
    states = []
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, IndexError), open(f"/proc/self/task/{tid}/stat") as f:
                name, rest = f.read().split("(", 1)[1].rsplit(")", 1)
                if name == "pt_gloo_runloop":
                    states.append(rest.split()[0])
    return states


def _wait_for_idle_gloo_workers(limit_s: float = 2.0, idle_needed: int = 5) -> None:
    """Until no gloo worker has been runnable for `idle_needed` polls in a row (a worker that wanted the GIL got
    it during the sleeps before), at most `limit_s`."""
    deadline, idle_polls = time.monotonic() + limit_s, 0
    while idle_polls < idle_needed and time.monotonic() < deadline:
        time.sleep(0.002)  # releases the GIL: a worker waiting for it finishes its release now
        idle_polls = 0 if "R" in _gloo_worker_states() else idle_polls + 1


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ParallelDims:
    """Data-parallel layout of a run; validated on construction.

    Args:
        dp_replicate: replicas of the sharded model (HSDP's outer axis); 1 = plain FSDP.
        dp_shard: ranks a parameter is sharded over; -1 = whatever is left of ``world_size``.
        cp: context-parallel ranks (a sequence is split over them; they also shard parameters).
        cp_ulysses: the Ulysses ranks inside cp (innermost); the ring spans ``cp / cp_ulysses`` of them.
        ep: expert-parallel ranks, borrowed from ``dp_shard * cp`` (must divide it).
        tp: tensor-parallel ranks (innermost axis; not yet together with cp or ep).
        world_size: number of processes.

    Raises:
        ValueError: when the sizes cannot tile ``world_size``; the message names the sizes and the
            valid choices.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    ep: int = 1
    world_size: int = field(default=-1)
    cp_ulysses: int = 1
    tp: int = 1
    _world_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.world_size == -1 and dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size()
        ws = self.world_size
        if not isinstance(ws, int) or ws < 1:
            raise ValueError(
                f"world_size must be a positive integer (or -1 inside an initialised process "
                f"group), got world_size={ws!r}"
            )
        for name in ("dp_replicate", "cp", "cp_ulysses", "ep", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{name} must be an integer >= 1, got {name}={value!r} "
                    f"(valid choices for world_size={ws}: {_divisors(ws)})"
                )
        if not isinstance(self.dp_shard, int) or (self.dp_shard < 1 and self.dp_shard != -1):
            raise ValueError(
                f"dp_shard must be -1 (fill in) or an integer >= 1, got dp_shard={self.dp_shard!r}"
            )
        if self.cp % self.cp_ulysses:
            raise ValueError(f"cp_ulysses={self.cp_ulysses} must divide cp={self.cp}; valid choices for "
                             f"cp_ulysses: {_divisors(self.cp)}")
        for other in ("cp", "ep"):  # not supported together yet: refused in one line
            if self.tp > 1 and getattr(self, other) > 1:
                raise ValueError(f"tp={self.tp} with {other}={getattr(self, other)}: tensor parallelism together with "
                                 f"{'context' if other == 'cp' else 'expert'} parallelism is not supported yet; valid "
                                 f"choices: tp=1 or {other}=1")
        tp_names, tp_sizes = (" * tp", f" * {self.tp}") if self.tp > 1 else ("", "")
        if self.dp_shard == -1:
            rest = self.dp_replicate * self.cp * self.tp
            if ws % rest:
                raise ValueError(
                    f"dp_shard=-1 cannot be filled in: dp_replicate * cp{tp_names} = {self.dp_replicate} * "
                    f"{self.cp}{tp_sizes} = {rest} does not divide world_size={ws}; valid choices for "
                    f"dp_replicate * cp{tp_names}: {_divisors(ws)}"
                )
            self.dp_shard = ws // rest
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != ws:
            raise ValueError(
                f"dp_replicate * dp_shard * cp{tp_names} = {self.dp_replicate} * {self.dp_shard} * {self.cp}"
                f"{tp_sizes} = {product} must equal world_size={ws}; valid choices: sizes whose product is "
                f"{ws} (divisors: {_divisors(ws)}), or dp_shard=-1 to fill in"
            )
        if self.fsdp_size % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp_shard * cp = {self.dp_shard} * {self.cp} = "
                f"{self.fsdp_size}; valid choices for ep: {_divisors(self.fsdp_size)}"
            )

    # ---- derived sizes ---------------------------------------------------------------------
    @property
    def fsdp_size(self) -> int:
        """Ranks a parameter is sharded over: ``dp_shard * cp``."""
        return self.dp_shard * self.cp

    @property
    def efsdp_size(self) -> int:
        """Ranks an expert's parameters are sharded over: ``dp_shard * cp / ep``."""
        return self.fsdp_size // self.ep

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: ``dp_replicate * dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.fsdp_size > 1

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1 and self.fsdp_size > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def same_batch_size(self) -> int:
        """Ranks that see the same batch (the axes of AXES marked same_batch: cp x tp)."""
        return self.cp * self.tp

    @property
    def world_mesh(self) -> DeviceMesh:
        """The mesh from the last :meth:`build_mesh` call."""
        if self._world_mesh is None:
            raise RuntimeError("call ParallelDims.build_mesh(device_type) first")
        return self._world_mesh

    # ---- mesh --------------------------------------------------------------------------------
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build the named world mesh (collective: every rank must call it).

        Axes ``dp_replicate, dp_shard, cp, tp`` (sizes may be 1) plus the flattened views ``dp``,
        ``dp_shard_cp`` and ``dp_cp``; with ``ep > 1`` also the expert mesh (:func:`expert_mesh`).
        """
        dist_backend(device_type)  # validates the device type
        if dist.is_initialized() and dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims.world_size={self.world_size} but the process group has "
                f"{dist.get_world_size()} ranks"
            )
        mesh = init_device_mesh(
            device_type,
            tuple(getattr(self, name) for name in MESH_DIM_NAMES),
            mesh_dim_names=MESH_DIM_NAMES,
        )
        # Keep the flattened meshes ourselves: slicing a flattened name from the root works
        # (``mesh["dp_shard_cp"]``) but torch is deprecating it, so our helpers never do.
        meshes = {name: mesh[name] for name in MESH_DIM_NAMES}
        meshes["dp"] = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        meshes["dp_shard_cp"] = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        meshes["dp_cp"] = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        context = meshes["cp"]._unflatten(0, (self.cp // self.cp_ulysses, self.cp_ulysses), ("cp_ring", "cp_ulysses"))
        meshes["cp_ring"], meshes["cp_ulysses"] = context["cp_ring"], context["cp_ulysses"]
        meshes["hsdp"] = meshes["dp_cp"]._unflatten(
            0, (self.dp_replicate, self.fsdp_size), ("dp_replicate", "dp_shard_cp")
        )
        if self.ep_enabled:
            expert = meshes["dp_cp"]._unflatten(
                0, (self.dp_replicate, self.efsdp_size, self.ep), ("dp_replicate", "efsdp", "ep")
            )
            meshes["expert"] = expert
            meshes["ep"] = expert["ep"]
            meshes["efsdp"] = expert["efsdp"]
            meshes["expert_fsdp"] = expert["dp_replicate", "efsdp"] if self.dp_replicate > 1 else expert["efsdp"]
        self._world_mesh = mesh
        self._meshes = meshes
        return mesh

    def get_mesh(self, name: str) -> DeviceMesh:
        """A named view of the built mesh: an axis (``dp_replicate``, ``dp_shard``, ``cp``, ``tp``), a
        flattened view (``dp``, ``dp_shard_cp``, ``dp_cp``), ``hsdp`` (2-D replicate x shard), the cp group's
        ``cp_ring`` and ``cp_ulysses`` (Ulysses innermost), and only with
        ``ep > 1``: ``expert`` (3-D ``dp_replicate x efsdp x ep``), ``ep``, ``efsdp`` and ``expert_fsdp``."""
        self.world_mesh  # noqa: B018 - raises if the mesh was not built
        try:
            return self._meshes[name]
        except KeyError:
            raise KeyError(f"no mesh named {name!r}; valid choices: {sorted(self._meshes)}") from None


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The mesh FSDP shards over: 1-D ``dp_shard_cp``, or 2-D ``(dp_replicate, dp_shard_cp)`` (HSDP).

    ``mesh`` is normally the one ``dims.build_mesh`` returned; a mesh built elsewhere with the
    same axis names (accelerate's ``ParallelismConfig`` uses them) is sliced by name instead.
    """
    if dims._world_mesh is mesh:
        return dims.get_mesh("hsdp" if dims.dp_replicate > 1 else "dp_shard_cp")
    names = ("dp_replicate", "dp_shard_cp") if dims.dp_replicate > 1 else ("dp_shard_cp",)
    try:
        return mesh[names]
    except (KeyError, RuntimeError, ValueError) as exc:
        raise ValueError(
            f"fsdp_mesh: the mesh has axes {mesh.mesh_dim_names}, not {names}; build it with "
            "dims.build_mesh(device_type)"
        ) from exc


def expert_mesh(dims: ParallelDims) -> DeviceMesh | None:
    """The 3-D ``(dp_replicate, efsdp, ep)`` expert mesh over the world (None unless ``ep > 1``)."""
    return dims.get_mesh("expert") if dims.ep_enabled else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
