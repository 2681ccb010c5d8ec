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

hpZ (``zero_optimization.zero_hpz_partition_size = H``, ZeRO-3 over the whole world only) adds a
*secondary group* of ``H`` consecutive ranks, ``[k * H, (k + 1) * H)``: the runtime's third
communicator, over which gathers read the node-local secondary copies (docs/design/hpz.md).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch.distributed as dist

SHARD_SIZE_KEY = "zero_optimization.mics_shard_size"
HPZ_SIZE_KEY = "zero_optimization.zero_hpz_partition_size"


@dataclasses.dataclass(frozen=True)
class ShardTopology:
    world_size: int
    shard_size: int
    shard_group: Optional[dist.ProcessGroup]  # the world group when there are no replicas
    replica_group: Optional[dist.ProcessGroup]  # None when there are no replicas
    # hpZ: the node-local group secondary copies are sharded over, and its size (None / 1: off).
    secondary_group: Optional[dist.ProcessGroup] = None
    secondary_size: int = 1

    @property
    def hybrid(self) -> bool:
        return self.replica_group is not None

    @property
    def hpz(self) -> bool:
        return self.secondary_group is not None

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
_GROUPS: Dict[Tuple[int, ...], ShardTopology] = {}


def _consecutive_groups(size: int) -> dist.ProcessGroup:
    """This rank's group among the groups of ``size`` consecutive ranks (every rank creates all)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for k in range(world // size):
        group = dist.new_group(list(range(k * size, (k + 1) * size)))
        if rank // size == k:
            mine = group
    return mine


def build_topology(shard_size: int, hpz_size: int = 1) -> ShardTopology:
    """The shard and replica groups of this rank for ``shard_size`` (a divisor of the world size),
    and with ``hpz_size > 1`` (plain sharding only) hpZ's secondary group. Collective: every rank
    creates every group, in the same order (torch.distributed's rule)."""
    world = dist.get_world_size()
    if hpz_size != 1:
        if shard_size != world:
            raise ValueError(f"{HPZ_SIZE_KEY} and hybrid sharding ({SHARD_SIZE_KEY}) cannot be combined")
        if hpz_size < 1 or world % hpz_size != 0:
            raise ValueError(f"{HPZ_SIZE_KEY} is {hpz_size}, which does not divide the world size {world}")
        key = (id(dist.group.WORLD), shard_size, hpz_size)
        if key not in _GROUPS:
            secondary = dist.group.WORLD if hpz_size == world else _consecutive_groups(hpz_size)
            _GROUPS[key] = ShardTopology(world, world, dist.group.WORLD, None, secondary, hpz_size)
        return _GROUPS[key]
    if shard_size == world:
        return ShardTopology(world, world, dist.group.WORLD, None)
    key = (id(dist.group.WORLD), shard_size)
    if key not in _GROUPS:
        rank = dist.get_rank()
        replica_group = None
        shard_group = _consecutive_groups(shard_size)
        for i in range(shard_size):
            group = dist.new_group(list(range(i, world, shard_size)))
            if rank % shard_size == i:
                replica_group = group
        _GROUPS[key] = ShardTopology(world, shard_size, shard_group, replica_group)
    return _GROUPS[key]


def topology_for(config_value: int, argument: Optional[int], hpz_size: int = 1) -> ShardTopology:
    """What ``initialize`` uses: the shard size checked, then its groups (and hpZ's, with
    ``hpz_size`` > 1, which Config.resolve checked against the world)."""
    return build_topology(shard_size_of(config_value, argument, dist.get_world_size()), hpz_size)
