"""The parameters of a frozen model partitioned over the ranks, with no deepcompile runtime: what
the served ZeRO-3 frozen engine (frozen_zero3.py) holds between forwards.

Each parameter keeps a :class:`FrozenShard` in its ``__dict__``: this rank's contiguous
``ceil(numel/world)`` elements of the flattened value (the last rank's zero-padded), on the
engine's device, in the compute dtype. The same cut as the served ``zero.Init``'s slices
(zero_init.Preset), so a model built there hands its slices over without a gather. Between uses
``param.data`` is an empty tensor, as DeepSpeed leaves a partitioned parameter.

Gathering is counted: a parameter is gathered by the first user (a module's forward pre-hook, a
leaf module's, a ``GatheredParameters`` block) and released by the last, so nested and tied uses
issue one gather and every rank issues the same collectives (the counts move the same way on
every rank). All collectives run over the default process group with torch.distributed alone:
nothing here touches the runtime or ``gathered_params``' registry, which belong to the trained
engine (two engines sharing those was issue 41).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from deepcompile.zero.gathered_params import ZeroParamStatus

SHARD = "_dc_frozen_shard"
_HALF = (torch.bfloat16, torch.float16)


def _wire(t: torch.Tensor) -> torch.Tensor:
    # gloo does not carry every half type on every torch version; fp32 holds them exactly.
    return t.float() if t.device.type == "cpu" and t.dtype in _HALF else t


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


class FrozenShard:
    """One parameter's shard and how many users hold it gathered now."""

    def __init__(self, index: int, shape: torch.Size, local: torch.Tensor):
        self.index = index  # the order every rank gathers in
        self.shape = torch.Size(shape)
        self.local = local  # flat, chunk elements
        self.users = 0

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def full(self) -> torch.Tensor:
        """The full value, gathered from every rank's shard. Collective."""
        world = dist.get_world_size()
        mine = _wire(self.local)
        out = torch.empty(mine.numel() * world, dtype=mine.dtype, device=mine.device)
        dist.all_gather_into_tensor(out, mine)
        return out[:self.numel].to(self.local.dtype).view(self.shape)

    def keep(self, full: torch.Tensor) -> None:
        """This rank's part of ``full`` (the same on every rank) becomes the shard."""
        chunk, rank = self.local.numel(), dist.get_rank()
        part = full.reshape(-1)[rank * chunk:(rank + 1) * chunk]
        with torch.no_grad():
            self.local.zero_()
            self.local[:part.numel()].copy_(part)


def shard_of(param: torch.Tensor) -> Optional[FrozenShard]:
    return param.__dict__.get(SHARD)


def cut(full: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This rank's padded flat shard of ``full`` (the same on every rank)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    chunk = -(-full.numel() // world)
    local = torch.zeros(chunk, dtype=dtype, device=device)
    part = full.detach().reshape(-1)[rank * chunk:(rank + 1) * chunk]
    local[:part.numel()].copy_(part)
    return local


def install(param: nn.Parameter, index: int, shape: torch.Size, local: torch.Tensor) -> None:
    """``param`` becomes partitioned: its shard recorded, its ``.data`` empty, DeepSpeed's
    ``ds_*`` attributes set (``ds_id`` is what LoRA savers test for ZeRO-3)."""
    param.__dict__[SHARD] = FrozenShard(index, shape, local)
    param.data = _empty(local.dtype, local.device)
    param.ds_id, param.ds_shape, param.ds_numel = index, torch.Size(shape), torch.Size(shape).numel()
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE


def _ordered(params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    unique = {id(p): p for p in params if shard_of(p) is not None}.values()
    return sorted(unique, key=lambda p: shard_of(p).index)  # one order on every rank


def acquire(params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Each partitioned parameter of ``params`` holds its full value in ``.data`` until the
    matching :func:`release`. Returns the ones counted (pass them to ``release``). Collective."""
    held = _ordered(params)
    with torch.no_grad():
        for p in held:
            shard = shard_of(p)
            if shard.users == 0:
                p.data = shard.full()
                p.ds_status = ZeroParamStatus.AVAILABLE
            shard.users += 1
    return held


def release(held: Sequence[torch.Tensor]) -> None:
    for p in held:
        shard = shard_of(p)
        shard.users -= 1
        if shard.users == 0:
            p.data = _empty(shard.local.dtype, shard.local.device)
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE


class FrozenGather:
    """``GatheredParameters`` over a frozen engine's parameters: full values for the block;
    on exit ``modifier_rank``'s values (None: discarded) are cut into every rank's shard.
    Collective: every rank enters with the same parameters."""

    def __init__(self, params: Sequence[torch.Tensor], modifier_rank: Optional[int]):
        self._params = _ordered(params)
        self._modifier_rank = modifier_rank
        self._held: List[torch.Tensor] = []

    def __enter__(self) -> "FrozenGather":
        self._held = acquire(self._params)
        return self

    def __exit__(self, *exc: object) -> bool:
        try:
            if self._modifier_rank is not None and exc[0] is None:
                with torch.no_grad():
                    for p in self._held:
                        wire = _wire(p.data.detach()).clone()
                        dist.broadcast(wire, src=self._modifier_rank)
                        shard_of(p).keep(wire)
                        if shard_of(p).users > 1:  # an enclosing user keeps reading .data
                            p.data.copy_(wire.view(p.data.shape))
        finally:
            release(self._held)
            self._held = []
        return False


class _Handed:
    """A handed-back shard as the engine's materialisation takes a preset value (materialize.py)."""

    def __init__(self, shard: FrozenShard):
        self._shard = shard

    def full(self, device: torch.device) -> torch.Tensor:
        return self._shard.full().to(device)


def hand_over(model: nn.Module) -> None:
    """For a training engine taking a model a frozen engine held (Trainer's ``evaluate()`` before
    ``train()``): each partitioned parameter becomes a ``meta`` tensor carrying its shard under
    ``materialize.PRESET_VALUE``, which the engine gathers one parameter at a time, as it takes
    the served ``zero.Init``'s slices. The caller removed the gather hooks."""
    from deepcompile.zero.materialize import PRESET_VALUE

    for p in model.parameters():
        shard = p.__dict__.pop(SHARD, None)
        if shard is None:
            continue
        for key in ("ds_id", "ds_shape", "ds_numel", "ds_status"):
            p.__dict__.pop(key, None)
        attributes = dict(p.__dict__)
        torch.utils.swap_tensors(p, nn.Parameter(torch.empty(shard.shape, dtype=shard.local.dtype, device="meta"),
                                                 requires_grad=p.requires_grad))
        p.__dict__.update(attributes)
        p.__dict__[PRESET_VALUE] = _Handed(shard)


def held_elements(model: nn.Module) -> Dict[str, int]:
    """Elements of each partitioned parameter this rank holds: its shard, plus the full value
    while gathered."""
    return {name: shard_of(p).local.numel() + p.data.numel()
            for name, p in model.named_parameters() if shard_of(p) is not None}
