"""ZeRO-3 parameter partitioning.

Each parameter is flattened, padded to a multiple of the world size and split: rank ``r`` keeps
elements ``[r * ppr, (r + 1) * ppr)`` as its shard. The module keeps its Parameter objects, whose
``.data`` becomes a *placeholder*: a one-element tensor expanded to the full shape, whose storage
refuses every read (``compat.forbid_data_access``). Dynamo therefore traces and guards the true
shape (no patches of its fake-tensor machinery), while any use that was not replaced by a gather
raises an error naming the parameter instead of computing with made-up values (DeepSpeed's
placeholders are empty tensors: a read of one fails on a shape, or silently, by broadcasting). The
graph passes replace every use by ``dc.allgather_param``; frames Dynamo runs eagerly gather through
``eager_fallback``.

A trainable parameter's shard is stored in fp32: it is the optimizer's master copy and, at the
same time, the source the runtime all-gathers from, cast on the way to the gather dtype the
precision policy names (``PrecisionPolicy.gather_dtype``: the parameter's dtype). There is no second shard in the parameter's dtype to keep in sync. Frozen
parameters keep their shard in the parameter's dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from deepcompile import compat
from deepcompile.zero.materialize import InitFn, Materialized, materialize


def placeholder_message(what: str) -> str:
    return (f"{what} is partitioned by ZeRO-3: outside the engine's forward its tensor is a placeholder "
            "of the full shape that holds no values. Read it inside "
            "deepspeed.zero.GatheredParameters(params) (deepcompile.zero.gathered_params), or use "
            "deepspeed.utils.safe_get_full_fp32_param; its shape without a gather is param.ds_shape.")


def make_placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device,
                     what: str = "this parameter") -> torch.Tensor:
    """A tensor of ``shape`` over one element whose data cannot be read: any kernel, copy or print
    of it raises :func:`placeholder_message` (``what`` names the parameter). Made while tracing
    (fake or meta), nothing is refused; the one element is NaN there (0 for integer dtypes)."""
    fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
    one = torch.full((1,), fill, dtype=dtype, device=device)
    compat.forbid_data_access(one, placeholder_message(what))
    return one.expand(shape)


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
    gather_dtype: torch.dtype  # what gathers return (the precision policy's; the parameter's dtype)
    # (ppr,) fp32 master weights (trainable params only): a Parameter over the storage of `shard`.
    master: Optional[torch.Tensor] = None

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad


def shard_of(full: torch.Tensor, rank: int, world: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """This rank's (ppr,) slice of the flattened, zero-padded tensor, in ``dtype`` (default:
    ``full``'s). Only the slice is allocated, never a padded copy of the whole tensor."""
    flat = full.detach().reshape(-1)
    numel = flat.numel()
    ppr = -(-numel // world)
    start = min(rank * ppr, numel)
    end = min(start + ppr, numel)
    shard = torch.zeros(ppr, dtype=dtype or flat.dtype, device=flat.device)
    shard[: end - start] = flat[start:end]
    return shard


def partition_parameters(
    module: nn.Module,
    persistence_threshold: int,
    group: Optional[dist.ProcessGroup] = None,
    *,
    device: Optional[torch.device] = None,
    init_fn: Optional[InitFn] = None,
    gather_dtype: Callable[[torch.Tensor], torch.dtype],
    init_group: Optional[dist.ProcessGroup] = None,
) -> Tuple[List[ShardedParam], Materialized]:
    """Shard every parameter of ``module`` (tied parameters once) on ``device`` and install
    placeholders; returns the sharded parameters (ds ids in ``named_parameters`` order) and what
    could not be given a value (a ``meta`` model without ``init_fn``).

    Parameters are materialised module by module (``materialize.py``: from ``init_fn``, rank 0's
    values, or left unset) and each is cut to this rank's shard as soon as its value is final, so
    a rank holds its shards plus one module's full parameters at a time: peak memory is
    O(numel / world + the largest module's parameters).

    ``gather_dtype`` (``PrecisionPolicy.gather_dtype``) gives the dtype each parameter's gathers
    return, asked once its value is final.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if device is None:
        device = next(module.parameters()).device
    order: Dict[int, Tuple[int, str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        order.setdefault(id(param), (len(order), name))
    slots: List[Optional[ShardedParam]] = [None] * len(order)

    def cut(param: nn.Parameter) -> None:
        ds_id, name = order[id(param)]
        numel = param.numel()
        # A trainable parameter's shard is its fp32 master copy (for an fp32 parameter the
        # shard itself, not a copy); a frozen one keeps the parameter's dtype.
        shard = shard_of(param.data, rank, world, torch.float32 if param.requires_grad else param.dtype)
        slots[ds_id] = ShardedParam(
            ds_id=ds_id,
            name=name,
            param=param,
            shape=param.shape,
            numel=numel,
            ppr=shard.numel(),
            shard=shard,
            persistent=numel <= persistence_threshold,
            gather_dtype=gather_dtype(param),
        )
        # Frees the full tensor (the module held the only reference).
        param.data = make_placeholder(param.shape, param.dtype, device, f"ZeRO-3 parameter {name!r}")
        param.ds_id = ds_id  # lets graph passes and users identify partitioned parameters

    # Values come from the first rank of ``init_group`` (default ``group``): the world under
    # hybrid sharding, where ``group`` is one shard group and every replica must start the same.
    materialized = materialize(module, device, init_group if init_group is not None else group, init_fn, cut)
    assert all(sp is not None for sp in slots), "a parameter was never materialised"
    return slots, materialized
