"""Sequence-parallel process groups: ``P`` consecutive ranks share one sequence.

With ``sequence_parallel_size = P`` dividing the world ``W``, ranks ``[k * P, (k + 1) * P)`` form
sequence-parallel group ``k``: each holds a contiguous ``1 / P`` slice of the same sequences (the
slices in rank order), and attention's all-to-all runs inside the group. The ``W / P`` groups are
the data-parallel replicas: they see different batches. ZeRO keeps partitioning over its own
groups (the whole world by default, as DeepSpeed's Ulysses/ALST does), so parameter shards span
the sequence-parallel ranks too; every rank's gradient is then an equal part of the average
(docs/design/sequence-parallel.md gives the arithmetic).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

SIZE_KEY = "sequence_parallel_size"


@dataclasses.dataclass(frozen=True)
class SequenceParallelGroups:
    size: int  # ranks per sequence (P)
    rank: int  # this rank's index inside its group: which slice of the sequence it holds
    group: Optional[dist.ProcessGroup]  # None when size is 1
    group_ranks: List[int]  # the global ranks of this rank's group, in slice order
    data_parallel_size: int  # W / P: the replicas that see different batches
    data_parallel_rank: int  # which of them this rank is in

    @property
    def enabled(self) -> bool:
        return self.size > 1


def check_size(size: int, world_size: int) -> None:
    """ValueError unless ``size`` ranks per sequence tile ``world_size`` ranks."""
    if size < 1 or world_size % size:
        raise ValueError(f"{SIZE_KEY} = {size} must divide the world size {world_size} "
                         f"(groups of {size} consecutive ranks share each sequence)")


# Groups already made, per default process group and size: a front end that makes them before the
# engine (the served deepspeed.runtime.sequence_parallel.ulysses_sp, whose mpu the engine is then
# given) and the engine share one set instead of creating the groups twice.
# Each entry keeps the default group it was made under alive, so that a later default group (after
# destroy_process_group and a new init) can never reuse its id and be handed stale groups.
_MADE: Dict[Tuple[int, int], Tuple[dist.ProcessGroup, "SequenceParallelGroups"]] = {}


def build_groups(size: int) -> SequenceParallelGroups:
    """This rank's sequence-parallel group; every rank must call it (``new_group`` is collective),
    except that a size made before under the same default group returns the groups made then."""
    world, rank = dist.get_world_size(), dist.get_rank()
    check_size(size, world)
    world_group = dist.group.WORLD
    key = (id(world_group), size)
    if key in _MADE and _MADE[key][0] is world_group:
        return _MADE[key][1]
    first = rank // size * size
    mine: Optional[dist.ProcessGroup] = None
    if size > 1:
        for start in range(0, world, size):
            group = dist.new_group(list(range(start, start + size)))
            if start == first:
                mine = group
    made = SequenceParallelGroups(size=size, rank=rank - first, group=mine,
                                  group_ranks=list(range(first, first + size)),
                                  data_parallel_size=world // size, data_parallel_rank=rank // size)
    _MADE[key] = (world_group, made)
    return made
