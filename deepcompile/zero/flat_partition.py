"""ZeRO-1/2 layout: each optimizer param group as one flat vector, partitioned over the ranks.

A group's trainable parameters are flattened and laid end to end (parameter ``i`` at
``offsets[i]``), then padded to ``world * partition_numel``; rank ``r`` owns
``[r * partition_numel, (r + 1) * partition_numel)`` and keeps that slice of the fp32 master
weights. A parameter may straddle ranks: :meth:`GroupPartition.pieces` says which part of each
parameter this rank owns, in the group's and in the parameter's own coordinates.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, List, Optional

import torch
import torch.nn as nn


@dataclasses.dataclass(frozen=True)
class OwnedPiece:
    """The overlap of one parameter with this rank's partition (possibly empty)."""

    param: nn.Parameter
    ds_id: int
    offset: int  # the parameter's first element in the group's flat vector
    begin: int  # overlap [begin, end) in the group's flat coordinates
    end: int
    partition_start: int  # this rank's first element in the group's flat coordinates

    @property
    def owned(self) -> bool:
        return self.end > self.begin

    @property
    def in_partition(self) -> slice:
        """The overlap as a slice of this rank's partition (master weights, gradient partition)."""
        return slice(self.begin - self.partition_start, self.end - self.partition_start)

    @property
    def in_param(self) -> slice:
        """The overlap as a slice of the flattened parameter."""
        return slice(self.begin - self.offset, self.end - self.offset)


@dataclasses.dataclass
class GroupPartition:
    params: List[nn.Parameter]
    ds_ids: List[int]
    offsets: List[int]  # flat offset of each parameter in the group
    partition_numel: int
    rank: int
    master: nn.Parameter  # (partition_numel,) fp32, this rank's slice of the group
    grad: Optional[torch.Tensor] = None  # step-local fp32 gradient partition

    def pieces(self) -> Iterator[OwnedPiece]:
        """Every parameter of the group with the part of it this rank owns, in group order."""
        lo, hi = self.rank * self.partition_numel, (self.rank + 1) * self.partition_numel
        for p, ds_id, off in zip(self.params, self.ds_ids, self.offsets):
            begin = min(max(off, lo), off + p.numel())
            end = max(min(off + p.numel(), hi), begin)
            yield OwnedPiece(p, ds_id, off, begin, end, lo)


def flat_offsets(params: List[nn.Parameter]) -> List[int]:
    """Where each parameter starts in the group's flat vector."""
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    return offsets


def build_group(params: List[nn.Parameter], ds_ids: List[int], rank: int, world: int) -> GroupPartition:
    """Lay ``params`` (identical on every rank) out flat and keep this rank's fp32 master slice."""
    offsets = flat_offsets(params)
    total = offsets[-1] + params[-1].numel() if params else 0
    partition = max(1, -(-total // world))
    flat = torch.zeros(partition * world, dtype=torch.float32, device=params[0].device if params else "cpu")
    for p, off in zip(params, offsets):
        flat[off : off + p.numel()] = p.detach().reshape(-1).float()
    master = nn.Parameter(flat[rank * partition : (rank + 1) * partition].clone())
    return GroupPartition(params, ds_ids, offsets, partition, rank, master)
