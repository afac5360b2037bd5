"""ParallelPlan: what a trainer asked for about parallelism, read once and passed down; and the one table of axes.

`AXES` (defined with the settings in mindspeed_hf.config.axes, so reading a config imports no torch; handed on
here) has one row per axis - dp_replicate, dp_shard, cp, ep, tp - from which the YAML keys, flags, variables,
accelerate's names, the mesh dimension names, the data-loader rule (which ranks see the same batch) and DeepSpeed's
exclusivity derive. A new axis = one row there + its ParallelConfig field + one step in parallelize + its module.

A `ParallelPlan` holds the request facts: the sizes (dp_shard filled in), where each was set, the FSDP2 options,
who asked, plus an unbuilt, validated `ParallelDims`. runtime/plan.py builds it (`resolve_plan`) before any
work; the prepare hook builds its mesh (a collective) from `plan.dims` and hands it to parallelize.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..config.axes import AXES, AXIS, SIZE_PATHS, WORLD_AXES, Axis
from .dims import ParallelDims

__all__ = ["AXES", "AXIS", "SIZE_PATHS", "WORLD_AXES", "Axis", "ParallelPlan"]


@dataclass(frozen=True)
class ParallelPlan:
    """What to build: mesh sizes (dp_shard filled in) and FSDP2 knobs, plus who asked for it.

    `size_sources` maps each size's setting path that a source set (`parallel.tp`) to that source; `dims` is the
    validated, unbuilt ParallelDims of the sizes (build its mesh with `new_dims(world).build_mesh(device_type)`).
    """

    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int
    reshard_after_forward: bool
    cpu_offload: bool
    prefetch: int
    cpu_ram_efficient_loading: bool
    sources: tuple[str, ...]
    layer_classes: tuple[str, ...] | None = None  # None: the model's _no_split_modules
    cp_ulysses: int = 1  # Ulysses ranks inside cp (the rest form the ring)
    tp: int = 1
    size_sources: dict[str, str] = field(default_factory=dict, compare=False)
    dims: ParallelDims | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_dims(cls, dims: ParallelDims, **facts) -> ParallelPlan:
        """The plan of validated `dims` (its sizes) and the other facts (knobs, sources)."""
        sizes = {axis.name: getattr(dims, axis.name) for axis in AXES}
        return cls(**sizes, cp_ulysses=dims.cp_ulysses, dims=dims, **facts)

    def size(self, axis: str | Axis) -> int:
        return getattr(self, axis if isinstance(axis, str) else axis.name)

    @property
    def same_batch(self) -> int:
        """Ranks that get the same batch (the product of the axes marked same_batch: cp x tp)."""
        result = 1
        for axis in AXES:
            if axis.same_batch:
                result *= self.size(axis)
        return result

    def new_dims(self, world_size: int) -> ParallelDims:
        """A fresh, unbuilt ParallelDims of these sizes over `world_size` processes (each build gets its own)."""
        return ParallelDims(self.dp_replicate, self.dp_shard, self.cp, self.ep, world_size=world_size,
                            cp_ulysses=self.cp_ulysses, tp=self.tp)

    def replace(self, **changes) -> ParallelPlan:
        return dataclasses.replace(self, **changes)
