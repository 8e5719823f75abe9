"""The job's ranks as a grid with named axes: pipeline x data (replicate, shard) x context x tensor,
and expert-parallel groups carved out of the data axis.

One `ParallelDims` is built from the config and the world size and then read by
everything that must agree on who holds what: the sampler (which data-parallel shard a
rank reads), the model wrappers (which ranks a parallelism spans) and the checkpoint
(recorded in the manifest).
"""

# --8<-- [start:imports]
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# --8<-- [end:imports]
from reference_impl.config import TrainConfig

# --8<-- [start:axes]
# Outermost first: ranks that differ only in the last axis (tp) are neighbours, so a
# tensor-parallel group sits on one node, where the links are fastest. These axes tile the
# world; expert parallel adds none: its groups are consecutive data-parallel ranks, so the
# data axis of D ranks is laid out as (ep_replicate, ep) = (D / ep, ep).
AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EP_AXES = ("ep_replicate", "ep")  # the data axis under expert parallel, outer first
# --8<-- [end:axes]


# --8<-- [start:parallel_dims]
@dataclass(frozen=True)
class ParallelDims:
    """How many ranks each axis spans; the product of `AXES`' degrees is the world size.

    Attributes:
        pp: Pipeline stages: ranks that each hold consecutive blocks and read the same samples.
        dp_replicate: Data-parallel replicas that hold whole copies (DDP).
        dp_shard: Data-parallel ranks that shard parameters between them (FSDP2).
        cp: Context-parallel ranks that split every sequence and read the same samples.
        tp: Tensor-parallel ranks that split every matmul and read the same samples.
        ep: Expert-parallel ranks: consecutive data-parallel ranks (each reads its own shard)
            that each hold n_experts / ep of the experts; it divides the data-parallel size,
            and the ranks at one position of every ep group (ep_replicate of them) hold the
            same experts.
        data_axis: The axis the data-parallel strategy occupies (dp_replicate or dp_shard).
        device_type: "cpu" or "cuda": the device the mesh's communicators serve.
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    data_axis: str = "dp_replicate"
    device_type: str = field(default="cpu", compare=False)

    @classmethod
    def from_config(cls, cfg: TrainConfig, data_axis: str, device_type: str = "cpu") -> ParallelDims:
        """The mesh of `cfg`: `pp_degree` stages, `cp_degree` context-parallel, `tp_degree`
        tensor-parallel ranks, and the rest of the world on `data_axis` (split into
        `dp_replicate` x dp_shard under HSDP), its ranks grouped `ep_degree` at a time into
        expert-parallel groups.

        `TrainConfig` has already refused degrees that do not divide the world size, before
        any process group started, so the degrees always multiply to it.
        """
        data = {data_axis: cfg.data_parallel_size // cfg.dp_replicate}
        if cfg.dp_replicate > 1:  # HSDP: the data axis is dp_shard, replicated dp_replicate times
            data["dp_replicate"] = cfg.dp_replicate
        return cls(pp=cfg.pp_degree, cp=cfg.cp_degree, tp=cfg.tp_degree, ep=cfg.ep_degree, data_axis=data_axis,
                   device_type=device_type, **data)

    def degree(self, axis: str) -> int:
        """How many ranks `axis` spans."""
        return int(getattr(self, axis))

    @property
    def world_size(self) -> int:
        """The product of the degrees of `AXES` (expert parallel splits the data axis)."""
        size = 1
        for axis in AXES:
            size *= self.degree(axis)
        return size

    @property
    def dp_size(self) -> int:
        """Ranks that read different samples: the data-parallel replicas times shards."""
        return self.dp_replicate * self.dp_shard

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global `rank` sits on each axis (row-major, `AXES` order)."""
        coords = {}
        for axis in reversed(AXES):
            rank, coords[axis] = divmod(rank, self.degree(axis))
        return {axis: coords[axis] for axis in AXES}

    def dp_rank(self, rank: int) -> int:
        """The data-parallel shard global `rank` reads: equal across its context- and
        tensor-parallel groups; the ranks of an expert-parallel group read different ones."""
        coords = self.coordinates(rank)
        return coords["dp_replicate"] * self.dp_shard + coords["dp_shard"]

    @property
    def ep_replicate(self) -> int:
        """Ranks that hold the same experts: the data-parallel size over `ep`."""
        return self.dp_size // self.ep

    def describe(self) -> dict[str, int]:
        """The degree of every axis and `ep`, as recorded in events and checkpoint manifests."""
        return {**{axis: self.degree(axis) for axis in AXES}, "ep": self.ep}

    @property
    def used_axes(self) -> tuple[str, ...]:
        """The axes that get a process group and a wrapper: those spanning more than one
        rank, or in a one-rank job the data axis (its wrapper runs over that one rank); `ep`
        last when it is above 1."""
        axes = tuple(axis for axis in AXES if self.degree(axis) > 1) or (self.data_axis,)
        return (*axes, "ep") if self.ep > 1 else axes

    def group(self, axis: str) -> ProcessGroup | None:
        """The process group of `axis` (one of `AXES` or `EP_AXES`) that this rank belongs
        to; None when it spans one rank."""
        return self.device_mesh[axis].get_group() if self.degree(axis) > 1 else None

    @cached_property
    def device_mesh(self) -> DeviceMesh:
        """The process groups of the used axes (collective: every rank builds it, in the
        same order). Only wrappers ask for it, so a single process never builds one. Under
        expert parallel the data axis is built as its two factors (`EP_AXES`)."""
        axes = tuple(a for axis in self.used_axes if axis != "ep"
                     for a in (EP_AXES if self.ep > 1 and axis == self.data_axis else (axis,)))
        return init_device_mesh(self.device_type, tuple(self.degree(a) for a in axes), mesh_dim_names=tuple(axes))
# --8<-- [end:parallel_dims]
