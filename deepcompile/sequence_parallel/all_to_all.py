"""The kernel of ``dcsp::all_to_all`` (schema, fake kernel and autograd formula: deepcompile/ops.py).

A process group is no schema type, so graphs name the group by an integer key into this module's
table; :func:`register_group` hands the key out. The kernel moves the ``P`` chunks with one
``all_to_all_single`` (gloo and NCCL both implement it) over a buffer that stacks the chunks
along a new leading dimension, then lays the received chunks out along the gather dimension.
"""

from __future__ import annotations

import itertools
from typing import Dict

import torch
import torch.distributed as dist

from deepcompile import ops

_GROUPS: Dict[int, dist.ProcessGroup] = {}
_NEXT_KEY = itertools.count(1)


def new_key() -> int:
    """A key no other group or document set of this process has (graphs name both by keys)."""
    return next(_NEXT_KEY)


def register_group(group: dist.ProcessGroup) -> int:
    """A key under which graphs reach ``group`` (kept until :func:`unregister_group`)."""
    key = new_key()
    _GROUPS[key] = group
    return key


def unregister_group(key: int) -> None:
    _GROUPS.pop(key, None)


def _all_to_all_kernel(x: torch.Tensor, scatter_dim: int, gather_dim: int, ranks: int, group: int) -> torch.Tensor:
    pg = _GROUPS.get(group)
    if pg is None:
        raise RuntimeError(f"dcsp::all_to_all: no sequence-parallel group under key {group} "
                           "(its engine was destroyed, or the graph belongs to another process)")
    if dist.get_world_size(pg) != ranks:
        raise RuntimeError(f"dcsp::all_to_all: the graph was traced for {ranks} ranks, "
                           f"the group has {dist.get_world_size(pg)}")
    if x.shape[scatter_dim] % ranks:
        raise ValueError(f"dcsp::all_to_all: dimension {scatter_dim} of {tuple(x.shape)} does not split "
                         f"into {ranks} equal parts")
    send = torch.stack(x.chunk(ranks, dim=scatter_dim))  # [ranks, *chunk], contiguous
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=pg)
    del send  # before the output exists: the op's peak is its input plus two buffers of its size
    return torch.cat(received.unbind(0), dim=gather_dim)


ops.register_sequence_parallel_kernel(_all_to_all_kernel)
