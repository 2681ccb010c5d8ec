"""ZeRO-3 parameter partitioning.

Each parameter is flattened, padded to a multiple of the world size and split: rank ``r`` keeps
elements ``[r * ppr, (r + 1) * ppr)`` as its shard. The module keeps its Parameter objects, whose
``.data`` becomes a *placeholder*: a one-element NaN tensor expanded to the full shape. Dynamo
therefore traces and guards the true shape (no patches of its fake-tensor machinery), while any
use that was not replaced by a gather produces NaNs instead of silently wrong numbers. The graph
passes replace every use by ``dc.allgather_param``; frames Dynamo runs eagerly gather through
``eager_fallback``.

A trainable parameter's shard is stored in fp32: it is the optimizer's master copy and, at the
same time, the source the runtime all-gathers from, cast to the parameter's dtype on the way
(``gather_dtype``). There is no second shard in the parameter's dtype to keep in sync. Frozen
parameters keep their shard in the parameter's dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn


def make_placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full((1,), float("nan"), dtype=dtype, device=device).expand(shape)


@dataclasses.dataclass
class ShardedParam:
    """One partitioned parameter: its id, full shape, local shard and gradient partition."""

    ds_id: int
    name: str
    param: nn.Parameter
    shape: torch.Size
    numel: int
    ppr: int
    # (ppr,) what the runtime gathers from: fp32 for trainable parameters (it is also the
    # optimizer's master copy), the parameter's dtype for frozen ones.
    shard: torch.Tensor
    persistent: bool
    gather_dtype: torch.dtype  # the parameter's dtype: what gathers return
    # (ppr,) fp32 master weights (trainable params only): a Parameter over the storage of `shard`.
    master: Optional[torch.Tensor] = None

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad


def shard_of(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's (ppr,) slice of the flattened, zero-padded tensor."""
    flat = full.detach().reshape(-1)
    ppr = -(-flat.numel() // world)
    padded = torch.zeros(ppr * world, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    return padded[rank * ppr : (rank + 1) * ppr].clone()


def _broadcast_from_first_rank(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    src = dist.get_global_rank(group, 0) if group is not None else 0
    # gloo cannot broadcast every half type on every torch version; fp32 carries them exactly.
    staged = t.float().contiguous() if t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16) else t.contiguous()
    dist.broadcast(staged, src=src, group=group)
    return staged.to(t.dtype)


def partition_parameters(
    module: nn.Module, persistence_threshold: int, group: Optional[dist.ProcessGroup] = None
) -> List[ShardedParam]:
    """Shard every parameter of ``module`` (tied parameters once) and install placeholders.

    Every rank must start from identical parameters: rank 0's values are broadcast first so that
    differently seeded ranks still train one model.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    sharded: List[ShardedParam] = []
    seen: Dict[int, ShardedParam] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        with torch.no_grad():
            full = _broadcast_from_first_rank(param.data, group)
        numel = full.numel()
        ppr = -(-numel // world)
        shard = shard_of(full, rank, world)
        if param.requires_grad:
            # The master copy is the shard: fp32 values of the (identical) parameter values.
            # For an fp32 parameter this is the shard itself, not a copy.
            shard = shard.float()
        sp = ShardedParam(
            ds_id=len(sharded),
            name=name,
            param=param,
            shape=param.shape,
            numel=numel,
            ppr=ppr,
            shard=shard,
            persistent=numel <= persistence_threshold,
            gather_dtype=param.dtype,
        )
        param.data = make_placeholder(param.shape, param.dtype, param.device)
        param.ds_id = sp.ds_id  # lets graph passes and users identify partitioned parameters
        seen[id(param)] = sp
        sharded.append(sp)
    return sharded
