"""Full ZeRO-3 parameters in their own ``.data`` for the span of a ``with`` block, as DeepSpeed's
``zero.GatheredParameters`` gives them to code that reads a parameter outside its module's
forward (TRL's fused LM head reads ``lm_head.weight`` directly, in the forward and again in its
backward).

Outside compiled graphs a partitioned parameter's ``.data`` is a placeholder of the full
shape (partition.py). Here it becomes a full copy gathered from every rank's shard; on exit the
placeholder comes back, after, with a ``modifier_rank``, that rank's values were written into
every rank's shard (the gather source, which is the fp32 master of a trainable parameter).

A gradient computed against the gathered value accumulates into the placeholder parameter's
``.grad``, where nothing else of deepcompile ever puts one (its own gathers are separate tensors
whose backward reduces). A post-accumulate hook hands such a gradient to the runtime's reduction
into the parameter's partition, as an eager gather's backward does, and clears ``.grad``.

Each live ZeRO-3 stage registers its parameters here (``register``), so that the served
``deepspeed`` package finds the stage of a parameter it is given.
"""

from __future__ import annotations

import enum
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from deepcompile import debug_checks, ops
from deepcompile.zero.eager_fallback import EAGER_GRAPH_ID, gather_full_copy
from deepcompile.zero.partition import make_placeholder


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's three states of a partitioned parameter, as ``param.ds_status`` reports them."""

    AVAILABLE = 1  # full values in .data
    NOT_AVAILABLE = 2  # only the placeholder in .data
    INFLIGHT = 3  # never reported here: gathers complete before the context is entered


# id(parameter) -> (its stage, its ShardedParam). Weak on the stage: a stage dropped without
# close() must not be kept alive by this table.
_owners: Dict[int, Tuple["weakref.ref", Any]] = {}


def register(sharding: Any) -> None:
    """Make ``sharding``'s (a Zero3Sharding) parameters known to ``gathered``; each gets
    ``ds_status``, ``ds_numel`` and ``ds_shape`` as DeepSpeed's partitioned parameters have them."""
    ref = weakref.ref(sharding)
    for sp in sharding.params:
        _owners[id(sp.param)] = (ref, sp)
        sp.param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        sp.param.ds_numel = sp.numel
        sp.param.ds_shape = sp.shape


def unregister(sharding: Any) -> None:
    for sp in sharding.params:
        entry = _owners.get(id(sp.param))
        if entry is not None and entry[0]() is sharding:
            del _owners[id(sp.param)]


def _owner(param: torch.Tensor):
    entry = _owners.get(id(param))
    if entry is None:
        return None
    sharding = entry[0]()
    return None if sharding is None else (sharding, entry[1])


def _reduce_accumulated(param: torch.Tensor) -> None:
    """Post-accumulate hook: the gradient of a gathered ``.data`` goes to the partition."""
    owner = _owner(param)
    if owner is None or param.grad is None:
        return
    grad, param.grad = param.grad, None
    debug_checks.note_reductions((owner[1].ds_id,))
    ops.reduce_grad(grad.contiguous(), EAGER_GRAPH_ID, owner[1].ds_id)


class Gathered:
    """The context: gathers ``params`` that a live ZeRO-3 stage partitioned (others are left
    alone: ZeRO-1/2 and unpartitioned parameters are whole already). Collective over the
    stage's group: every rank enters and leaves with the same parameters."""

    def __init__(self, params: Sequence[torch.Tensor], modifier_rank: Optional[int] = None):
        unique = {id(p): p for p in params}.values()
        owned = [(p, _owner(p)) for p in unique]
        # One order on every rank (the gathers are collectives), whatever order the caller used.
        self._owned = sorted(((p, o) for p, o in owned if o is not None), key=lambda e: e[1][1].ds_id)
        self._modifier_rank = modifier_rank
        self._entered: List[Tuple[torch.Tensor, Any]] = []

    def __enter__(self) -> "Gathered":
        for p, (sharding, sp) in self._owned:
            if p.ds_status is ZeroParamStatus.AVAILABLE:
                continue  # an enclosing context holds it; it restores it
            with torch.no_grad():
                full = gather_full_copy(p, sp.ds_id)
            p.data = full.to(p.dtype)
            p.ds_status = ZeroParamStatus.AVAILABLE
            if p.requires_grad and not getattr(p, "_dc_reduce_hook", False):
                p.register_post_accumulate_grad_hook(_reduce_accumulated)
                p._dc_reduce_hook = True
            self._entered.append((p, (sharding, sp)))
        return self

    def __exit__(self, *exc: Any) -> bool:
        try:
            if self._modifier_rank is not None and exc[0] is None:
                self._write_back()
        finally:
            for p, (_, sp) in self._entered:
                p.data = make_placeholder(sp.shape, p.dtype, p.device, f"ZeRO-3 parameter {sp.name!r}")
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE
            self._entered = []
        return False

    def _write_back(self) -> None:
        """``modifier_rank``'s full values into every rank's shard, then every gathered copy the
        runtime keeps (persistent parameters, prefetches) is dropped as stale."""
        stages = {}
        for p, (sharding, sp) in self._entered:
            # Over the world, from global rank ``modifier_rank`` (DeepSpeed's meaning): under hybrid
            # sharding the stage's group is one shard group, and every replica must take the same
            # values.
            value = p.data.detach()
            # gloo does not broadcast every half type on every torch version; fp32 holds them exactly.
            wire = value.float() if value.device.type == "cpu" and value.dtype in (torch.bfloat16, torch.float16) \
                else value.clone()
            dist.broadcast(wire, src=self._modifier_rank)
            shard = next(s for s in sharding.shards() if s.ds_id == sp.ds_id)
            with torch.no_grad():
                shard.local.copy_(wire.reshape(-1)[shard.start:shard.end])
            stages[id(sharding)] = sharding
        for sharding in stages.values():
            sharding.sync_params_from_shards()
