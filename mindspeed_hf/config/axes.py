"""The one table of parallel axes (dp_replicate, dp_shard, cp, ep, tp): every name an axis has elsewhere derives from
its row here - the ParallelConfig field and YAML key `parallel.<x>`, the `--mindspeed_<x>` flag, the
`MINDSPEED_HF_PARALLEL_<X>` variable, accelerate's `PARALLELISM_CONFIG_<X>_SIZE` variable and
`TrainingArguments.parallelism_config.<x>_size` attribute (where accelerate has the axis), the mesh dimension name,
whether the ranks along it see the same batch, and whether DeepSpeed excludes it.

It lives with the settings (no torch, nothing above config imported); `mindspeed_hf.parallel.plan` hands it on with
the ParallelPlan built from it. A new axis = one row here, its ParallelConfig field, one step in parallelize and its
module.
"""

from __future__ import annotations

from dataclasses import dataclass

from .schema import ENV_PREFIX, ParallelConfig


@dataclass(frozen=True)
class Axis:
    """One parallel axis and the names derived from it."""

    name: str  # the ParallelConfig field: dp_replicate, dp_shard, cp, ep, tp
    what: str  # what it builds, for messages ("context parallelism")
    accelerate: bool  # accelerate's ParallelismConfig has it (PARALLELISM_CONFIG_<X>_SIZE, parallelism_config.<x>_size)
    world: bool  # a dimension of the world mesh (ep borrows its ranks from dp_shard * cp instead)
    same_batch: bool  # the ranks along it get the same batch (the data loader splits over the others)
    deepspeed_excludes: bool = True  # DeepSpeed shards the model itself: refused together with this axis

    @property
    def path(self) -> str:
        """`parallel.tp`: the setting path and YAML key."""
        return f"parallel.{self.name}"

    @property
    def argument(self) -> str:
        """`mindspeed_tp`: the MindSpeedTrainingArguments field (flag `--mindspeed_tp`)."""
        return f"mindspeed_{self.name}"

    @property
    def flag(self) -> str:
        return f"--{self.argument}"

    @property
    def env(self) -> str:
        """`MINDSPEED_HF_PARALLEL_TP`."""
        return f"{ENV_PREFIX}PARALLEL_{self.name.upper()}"

    @property
    def accelerate_env(self) -> str | None:
        """`PARALLELISM_CONFIG_TP_SIZE` (what `accelerate launch` exports), or None."""
        return f"PARALLELISM_CONFIG_{self.name.upper()}_SIZE" if self.accelerate else None

    @property
    def accelerate_attribute(self) -> str | None:
        """`tp_size`: the attribute of accelerate's ParallelismConfig (TrainingArguments.parallelism_config)."""
        return f"{self.name}_size" if self.accelerate else None

    @property
    def mesh(self) -> str:
        """The mesh dimension name (ParallelDims.get_mesh)."""
        return self.name


#: The axes, world-mesh dimensions outermost first (the world mesh is dp_replicate x dp_shard x cp x tp).
AXES: tuple[Axis, ...] = (
    Axis("dp_replicate", "FSDP2", accelerate=True, world=True, same_batch=False),
    Axis("dp_shard", "FSDP2", accelerate=True, world=True, same_batch=False),
    Axis("cp", "context parallelism", accelerate=True, world=True, same_batch=True),
    Axis("ep", "expert parallelism", accelerate=False, world=False, same_batch=False),
    Axis("tp", "tensor parallelism", accelerate=True, world=True, same_batch=True),
)
AXIS = {axis.name: axis for axis in AXES}
#: the world mesh's dimension names, outermost first
WORLD_AXES: tuple[str, ...] = tuple(axis.mesh for axis in AXES if axis.world)
#: the setting paths of the sizes
SIZE_PATHS: tuple[str, ...] = tuple(axis.path for axis in AXES)

_FIELDS = {f for f in ParallelConfig.__dataclass_fields__}
assert all(axis.name in _FIELDS for axis in AXES), "every axis is a ParallelConfig field"
