"""Hybrid sharding's process groups: shard within a group of ranks, replicate across the groups.

With a shard size ``S`` that divides the world ``W``, the ranks split into ``W / S`` shard groups
of consecutive ranks ``[k * S, (k + 1) * S)``; parameters, gradients and optimizer state are
partitioned within each, and the ``S`` replica groups hold the ranks with the same index in every
shard group (ranks ``i, i + S, i + 2S, ...``), which therefore hold the same shard. This is the
layout of DeepSpeed's MiCS and of a 2-D device mesh ``(replicate, shard)``: with ``S`` the GPUs of
a node, every gather and reduce-scatter stays inside the node and only the gradient partitions'
all-reduce crosses nodes (docs/design/hybrid_sharding.md).

``S == W`` (the default) is plain ZeRO: the shard group is the world group itself and there is
no replica group, so nothing changes.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch.distributed as dist

SHARD_SIZE_KEY = "zero_optimization.mics_shard_size"


@dataclasses.dataclass(frozen=True)
class ShardTopology:
    world_size: int
    shard_size: int
    shard_group: Optional[dist.ProcessGroup]  # the world group when there are no replicas
    replica_group: Optional[dist.ProcessGroup]  # None when there are no replicas

    @property
    def hybrid(self) -> bool:
        return self.replica_group is not None

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_size

    def replica_index(self, rank: int) -> int:
        """Which shard group global ``rank`` is in (0 for the first)."""
        return rank // self.shard_size


def shard_size_of(config_value: int, argument: Optional[int], world_size: int) -> int:
    """The shard size from the config key (-1: the world) and ``initialize(shard_group_size=)``
    (None: the key decides); raises ValueError for a size that does not divide the world or for
    two sizes that disagree."""
    sizes = {v for v in (config_value, argument) if v is not None and v != -1}
    if len(sizes) > 1:
        raise ValueError(f"deepcompile.initialize: shard_group_size={argument} and {SHARD_SIZE_KEY}={config_value} "
                         "disagree; set one of them")
    size = sizes.pop() if sizes else world_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"deepcompile.initialize: the shard group size must be a positive integer (or -1 for the "
                         f"whole world), got {size!r}")
    if world_size % size != 0:
        raise ValueError(f"{SHARD_SIZE_KEY} / shard_group_size is {size}, which does not divide the world size "
                         f"{world_size}: every shard group must have the same number of ranks")
    return size


# Groups are made once per (world group, shard size) and process: dist.new_group is collective,
# and engines built one after another in one process (tests, notebooks) reuse them.
_GROUPS: Dict[Tuple[int, int], ShardTopology] = {}


def build_topology(shard_size: int) -> ShardTopology:
    """The shard and replica groups of this rank for ``shard_size`` (a divisor of the world size).
    Collective: every rank creates every group, in the same order (torch.distributed's rule)."""
    world = dist.get_world_size()
    if shard_size == world:
        return ShardTopology(world, world, dist.group.WORLD, None)
    key = (id(dist.group.WORLD), shard_size)
    if key not in _GROUPS:
        rank = dist.get_rank()
        shard_group = replica_group = None
        for k in range(world // shard_size):
            group = dist.new_group(list(range(k * shard_size, (k + 1) * shard_size)))
            if rank // shard_size == k:
                shard_group = group
        for i in range(shard_size):
            group = dist.new_group(list(range(i, world, shard_size)))
            if rank % shard_size == i:
                replica_group = group
        _GROUPS[key] = ShardTopology(world, shard_size, shard_group, replica_group)
    return _GROUPS[key]


def topology_for(config_value: int, argument: Optional[int]) -> ShardTopology:
    """What ``initialize`` uses: the shard size checked, then its groups."""
    return build_topology(shard_size_of(config_value, argument, dist.get_world_size()))
