"""A checkpoint read whole in one process, with no process group and no GPU (``deepcompile export``).

``engine.save_checkpoint`` writes every parameter as one logical 1-D tensor (``model/<name>``)
cut into the chunks the ranks held (dcp_checkpoint.py). Reading it back needs no engine: DCP's
no-process-group path (``dcp.load(..., no_dist=True)``) with :class:`FlatRangeLoadPlanner`
asking for the whole range ``[0, numel)`` assembles the chunks of any world size and stage into
the full tensor, which is then given the shape recorded in ``deepcompile.json``. Parameters are
read a batch at a time (``batch_bytes``), so memory holds one batch, not the model.

What is read: the parameters (fp32 masters for trained ones: the values the next step would
start from) and the persistent buffers. The optimizer state, the scheduler and the counters are
left on disk: an export is weights.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from deepcompile.checkpoint import layout
from deepcompile.checkpoint.agreement import CheckpointError
from deepcompile.checkpoint.dcp_checkpoint import BUFFERS, MODEL
from deepcompile.checkpoint.flat_planners import FlatRange, FlatRangeLoadPlanner
from deepcompile.precision.policy import PrecisionPolicy

DEFAULT_BATCH_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    name: str  # the module's state_dict name
    shape: Tuple[int, ...]
    dtype: torch.dtype
    is_parameter: bool

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


class OfflineCheckpoint:
    """Checkpoint ``<load_dir>/<tag>`` (default: the one ``latest`` names), opened for reading."""

    def __init__(self, load_dir: Any, tag: Any = None):
        self.path = layout.resolve(load_dir, tag)
        self.meta = layout.read_meta(self.path)
        self._stored = dcp.FileSystemReader(self.path).read_metadata().state_dict_metadata
        self.tensors: List[StoredTensor] = []
        damaged = []
        for kind, prefix, shapes in (("parameter", MODEL, self.meta["params"]), ("buffer", BUFFERS, self.meta["buffers"])):
            for name, entry in shapes.items():
                shape = tuple(entry["shape"] if kind == "parameter" else entry)
                md = self._stored.get(prefix + name)
                if not isinstance(md, TensorStorageMetadata):
                    damaged.append(prefix + name)
                    continue
                self.tensors.append(StoredTensor(name, shape, md.properties.dtype, kind == "parameter"))
        if damaged:
            raise CheckpointError(f"checkpoint {self.path!r} is damaged: its DCP metadata lacks {', '.join(damaged[:20])}")

    @property
    def world_size(self) -> int:
        return int(self.meta["world_size"])

    @property
    def zero_stage(self) -> int:
        return int(self.meta["zero_stage"])

    def training_dtype(self) -> Optional[torch.dtype]:
        """The dtype the parameters trained in (the saved config's precision policy: bf16 / fp16),
        or None: the dtype each parameter is stored in."""
        return PrecisionPolicy.from_saved_config(self.meta.get("config") or {}).param_dtype

    def read(self, batch_bytes: int = DEFAULT_BATCH_BYTES) -> Iterator[Tuple[StoredTensor, torch.Tensor]]:
        """Every parameter and buffer, full and shaped, in the order of ``deepcompile.json``, read
        about ``batch_bytes`` at a time."""
        batch: List[StoredTensor] = []
        size = 0
        for t in self.tensors:
            if batch and size + t.nbytes > batch_bytes:
                yield from self._read_batch(batch)
                batch, size = [], 0
            batch.append(t)
            size += t.nbytes
        if batch:
            yield from self._read_batch(batch)

    def _read_batch(self, batch: List[StoredTensor]) -> Iterator[Tuple[StoredTensor, torch.Tensor]]:
        values: Dict[str, torch.Tensor] = {}
        ranges, buffers = [], {}
        for t in batch:
            if t.is_parameter:
                flat = torch.empty(int(torch.Size(t.shape).numel()), dtype=t.dtype)
                values[t.name] = flat
                ranges.append(FlatRange(MODEL + t.name, flat.numel(), 0, flat))
            else:
                buffers[BUFFERS + t.name] = values[t.name] = torch.empty(t.shape, dtype=t.dtype)
        reader = dcp.FileSystemReader(self.path)
        if ranges:
            dcp.load({}, storage_reader=reader, planner=FlatRangeLoadPlanner(ranges), no_dist=True)
        if buffers:
            plain = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
            dcp.load(buffers, storage_reader=dcp.FileSystemReader(self.path), planner=plain, no_dist=True)
        for t in batch:
            yield t, values[t.name].view(t.shape)

    def describe(self) -> str:
        n = sum(int(torch.Size(t.shape).numel()) for t in self.tensors if t.is_parameter)
        return (f"{os.path.basename(self.path)}: ZeRO-{self.zero_stage}, {self.world_size} rank(s), step "
                f"{self.meta.get('global_steps')}, {sum(t.is_parameter for t in self.tensors)} parameters "
                f"({n:,} elements), {sum(not t.is_parameter for t in self.tensors)} buffers")
