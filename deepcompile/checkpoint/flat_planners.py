"""torch.distributed.checkpoint (DCP) planners for flat ranges of 1-D tensors.

Every rank holds, of each partitioned tensor (a parameter's fp32 master, a per-element
optimizer state), elements ``[start, end)`` of the full tensor flattened: the ranges tile it but
need not be even, and some ranks hold nothing (``zero/sharding.py``). DCP stores such a tensor as
one logical 1-D tensor of ``numel`` elements written as chunks with offsets; these planners add
one chunk per rank and range to DCP's default plans, and read back whichever overlap of the
stored chunks a rank's range needs, so another world size or stage re-cuts the same file.

Only public DCP surface is used: ``DefaultSavePlanner`` / ``DefaultLoadPlanner`` (documented to be
subclassed), the plan dataclasses and ``planner_helpers.create_read_items_for_chunk_list``.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import ReadItem, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


@dataclasses.dataclass(frozen=True, eq=False)
class FlatRange:
    """This rank's elements ``[start, start + local.numel())`` of the 1-D tensor ``key`` of
    ``numel`` elements. Saving reads ``local``; loading writes into it (a view: in place)."""

    key: str
    numel: int
    start: int
    local: torch.Tensor
    # Write a zero-length chunk from this range even though it is empty: a tensor with no
    # elements still needs one chunk to appear in the checkpoint (one rank does it). Only for
    # those: DCP counts an empty chunk inside another rank's chunk as an overlap.
    write_if_empty: bool = False

    def __post_init__(self) -> None:
        if self.local.dim() != 1 or not 0 <= self.start <= self.start + self.local.numel() <= self.numel:
            raise ValueError(f"{self.key}: a flat range must be a 1-D tensor inside [0, {self.numel}), got "
                             f"start {self.start}, shape {tuple(self.local.shape)}")

    @property
    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.start]), sizes=torch.Size([self.local.numel()]))


def _by_key(ranges: Iterable[FlatRange]) -> Dict[str, FlatRange]:
    out: Dict[str, FlatRange] = {}
    for r in ranges:
        if r.key in out:
            raise ValueError(f"two flat ranges for {r.key} on one rank")
        out[r.key] = r
    return out


class FlatRangeSavePlanner(DefaultSavePlanner):
    """Saves the state dict given to ``dcp.save`` as DCP's default planner does (no flattening of
    nested dicts: keys are used as given), plus one chunk per non-empty :class:`FlatRange`."""

    def __init__(self, ranges: Iterable[FlatRange]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.ranges = _by_key(ranges)

    def create_local_plan(self):
        plan = super().create_local_plan()
        items: List[WriteItem] = []
        for r in self.ranges.values():
            if r.local.numel() == 0 and not r.write_if_empty:
                continue
            items.append(WriteItem(
                index=MetadataIndex(r.key, torch.Size([r.start])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=r.chunk, properties=TensorProperties(dtype=r.local.dtype),
                                            size=torch.Size([r.numel])),
            ))
        self.plan = dataclasses.replace(plan, items=list(plan.items) + items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        r = self.ranges.get(write_item.index.fqn)
        if r is not None:
            return r.local.detach()
        return super().resolve_data(write_item)


class FlatRangeLoadPlanner(DefaultLoadPlanner):
    """Loads the state dict given to ``dcp.load`` as DCP's default planner does (keys as given),
    plus, for each non-empty :class:`FlatRange`, the parts of the stored chunks it overlaps."""

    def __init__(self, ranges: Iterable[FlatRange]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.ranges = _by_key(ranges)

    def create_local_plan(self):
        plan = super().create_local_plan()
        items: List[ReadItem] = []
        for r in self.ranges.values():
            if r.local.numel() == 0:
                continue
            items += create_read_items_for_chunk_list(r.key, self.metadata.state_dict_metadata[r.key], [r.chunk])
        return dataclasses.replace(plan, items=list(plan.items) + items)

    def resolve_tensor(self, read_item: ReadItem):
        r = self.ranges.get(read_item.dest_index.fqn)
        if r is not None:
            # Offsets are relative to this rank's range (its only chunk).
            return r.local.narrow(0, read_item.dest_offsets[0], read_item.lengths[0])
        return super().resolve_tensor(read_item)
