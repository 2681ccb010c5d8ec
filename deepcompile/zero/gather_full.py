"""Full parameters assembled on one rank from every rank's ``ParamShard``, one at a time.

For exports and rank-0 state dicts: the destination holds one full parameter at a time (plus a
staging buffer of the same size), the other ranks never more than their own piece. It uses only
``Sharding.shards()``, so it serves every stage: each rank sends its ``[start, end)`` piece
(padded to the longest piece of that parameter) with one ``gather``; the destination places the
pieces by their ranges, learnt once with one ``all_gather_object`` of every rank's ranges.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from deepcompile.zero.param_shard import ParamShard

_HALF = (torch.bfloat16, torch.float16)

# The tensors of the last gather issued here, kept referenced until the next one (or the
# process's end). gloo runs a collective on a worker thread, which drops its references after the
# caller's wait has returned; if it holds the last reference to a Python tensor, freeing it needs
# the GIL. When a rank's last collective before exit is this gather (save_model at the end of a
# run), the worker can get there while the interpreter finalizes, and CPython then ends the thread
# with a forced unwind that C++ turns into std::terminate: an abort at exit, seen on loaded hosts.
# Held here, the worker's reference is never the last. Only the last gather's tensors are held: a
# rank holds at most one piece more than before.
_last_pieces: List[torch.Tensor] = []


def gather_to_rank(shards: Iterable[ParamShard], dtype_of: Callable[[ParamShard], torch.dtype],
                   group: Optional[dist.ProcessGroup], dst: int = 0, device: Optional[torch.device] = None
                   ) -> Iterator[Tuple[ParamShard, Optional[torch.Tensor]]]:
    """Every shard's full parameter in ``dtype_of(shard)`` on group rank ``dst`` (None on the
    others), in ``shards`` order. ``device``: where the pieces travel from (default: each
    shard's own); a piece offload keeps in host memory is copied there one parameter at a time.
    Collective: every rank must exhaust the iterator."""
    shards = list(shards)
    _last_pieces.clear()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ranges = [None] * world
    dist.all_gather_object(ranges, [(s.start, s.end) for s in shards], group=group)
    dst_global = dist.get_global_rank(group, dst) if group is not None else dst
    for i, shard in enumerate(shards):
        dtype = dtype_of(shard)
        at = torch.device(device) if device is not None else shard.local.device
        # gloo cannot gather every half type on every torch version; fp32 carries them exactly.
        comm_dtype = torch.float32 if at.type == "cpu" and dtype in _HALF else dtype
        spans = [r[i] for r in ranges]
        width = max(max(end - start for start, end in spans), 1)
        piece = torch.zeros(width, dtype=comm_dtype, device=at)
        piece[: shard.end - shard.start] = shard.local
        if rank != dst:
            dist.gather(piece, None, dst=dst_global, group=group)
            _last_pieces[:] = [piece]
            del piece
            yield shard, None
            continue
        staged = torch.empty(world, width, dtype=comm_dtype, device=at)
        received = list(staged.unbind(0))
        dist.gather(piece, received, dst=dst_global, group=group)
        _last_pieces[:] = [piece, *received]
        del received
        del piece
        if all(start == r * width for r, (start, _) in enumerate(spans)):
            flat = staged.view(-1)[: shard.numel]  # ZeRO-3: rank r holds [r * width, (r + 1) * width)
        else:
            flat = torch.empty(shard.numel, dtype=comm_dtype, device=at)
            for r, (start, end) in enumerate(spans):
                flat[start:end] = staged[r, : end - start]
        full = flat.view(shard.shape).to(dtype)
        del staged, flat
        yield shard, full
