"""What optimizer-state offload moves: units, their state, and how they are found.

A unit is one whole device *storage*: a state tensor the optimizer created for a master (one per
parameter under ZeRO-3, one per param group under ZeRO-1/2), a ZeRO-1/2 master partition, and
with parameter offload a ZeRO-3 master shard. Moving it copies its bytes to a host buffer and
frees the device storage (``resize_(0)``); the tensor objects the optimizer holds stay the same.

A unit's state is two values, each an enum, instead of a set of flags that had to agree:

* ``Placement``: what the plan decided (stay on the device; go to the host between steps;
  go, and come back from the start of the boundary backward);
* ``Residence``: where its values are now (on the device with the host buffer stale or absent;
  on the device with the host buffer holding the same bytes, so a write-back can be skipped; on
  the host, the device storage freed).

The copies in flight (the last offload's and a reload's completion) are handles beside them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from deepcompile import compat

MASTER = "fp32 master"


class Placement(enum.Enum):
    RESIDENT = "resident"  # the plan keeps it on the device
    OFFLOADED = "offloaded"  # on the host between steps, reloaded before the step
    OFFLOADED_EARLY = "offloaded, reloaded in the backward"  # the budget leaves room beside the backward

    @property
    def offloaded(self) -> bool:
        return self is not Placement.RESIDENT


class Residence(enum.Enum):
    DEVICE = "device"  # the device copy is the only current one
    DEVICE_HOST_CURRENT = "device, host current"  # nothing wrote it since the last copy between the two
    HOST = "host"  # the device storage is freed; the host buffer holds the values


@dataclasses.dataclass(eq=False)
class OffloadUnit:
    """One device storage that may move to the host."""

    storage_key: int
    what: str  # MASTER or the optimizer's state key ("exp_avg", ...)
    ds_ids: List[int]  # the parameters whose state it holds
    device_bytes: torch.Tensor  # uint8 view of the whole device storage
    nbytes: int
    host: Optional[torch.Tensor] = None  # uint8 host buffer, allocated when first planned out
    placement: Placement = Placement.RESIDENT
    residence: Residence = Residence.DEVICE
    written: Any = None  # completion of the last offload copy
    reloading: Any = None  # completion of a reload copy the compute stream has not waited for yet

    @property
    def planned_out(self) -> bool:
        return self.placement.offloaded

    @property
    def early(self) -> bool:
        return self.placement is Placement.OFFLOADED_EARLY

    @property
    def on_host(self) -> bool:
        return self.residence is Residence.HOST

    @property
    def host_current(self) -> bool:
        """The host buffer holds the values (the unit is there, or came back unchanged)."""
        return self.residence is not Residence.DEVICE

    def device_written(self) -> None:
        """The device copy is (or may be) written: its host copy, if any, is stale."""
        if self.residence is Residence.DEVICE_HOST_CURRENT:
            self.residence = Residence.DEVICE

    @property
    def order_key(self) -> int:
        # Reload order: the parameters registered last are used last in the forward, so their
        # gradients are final first in the backward.
        return -max(self.ds_ids)


class UnitTable:
    """The known units by storage key, and which units hold each parameter's state."""

    def __init__(self) -> None:
        self.by_key: Dict[int, OffloadUnit] = {}
        self._of: Dict[int, List[OffloadUnit]] = {}

    def add(self, unit: OffloadUnit) -> None:
        self.by_key[unit.storage_key] = unit
        for ds_id in unit.ds_ids:
            self._of.setdefault(ds_id, []).append(unit)

    def replace_all(self, units: Dict[int, OffloadUnit]) -> None:
        self.by_key = units
        self._of = {}
        for unit in units.values():
            for ds_id in unit.ds_ids:
                self._of.setdefault(ds_id, []).append(unit)

    def remove(self, keys: set, ds_ids: set) -> None:
        """Forget the units ``keys`` (which hold only state of ``ds_ids``)."""
        for key in keys:
            self.by_key.pop(key, None)
        for i in ds_ids:
            if i in self._of:
                self._of[i] = [u for u in self._of[i] if u.storage_key not in keys]

    def of(self, ds_id: int) -> List[OffloadUnit]:
        return self._of.get(ds_id, [])

    def in_reload_order(self) -> List[OffloadUnit]:
        return sorted(self.by_key.values(), key=lambda u: u.order_key)

    def clear(self) -> None:
        self.by_key, self._of = {}, {}


class UnitFinder:
    """Finds the device storages that may move, through the stage's ``Sharding`` interface
    (``shards()`` and ``shard_optimizer_state()``), so no stage's layout is known here.

    The stage's shards are taken once, while all are on the device: the views stay valid (the
    same storages are emptied and refilled in place), and an emptied one could not be viewed
    again. ``finding`` is true while a search runs: reading the optimizer's state then goes
    through ``StateAccess.locate``, which must take views only (no copy needs to be complete)."""

    def __init__(self, sharding: Any, device: torch.device):
        self.sharding = sharding
        self.device = device
        self.shards = list(sharding.shards())
        self.finding = False

    @contextlib.contextmanager
    def _searching(self) -> Iterator[None]:
        self.finding = True
        try:
            yield
        finally:
            self.finding = False

    def find(self, known: Dict[int, OffloadUnit], only_ids: Optional[set] = None) -> Dict[int, OffloadUnit]:
        """The device storages that may move, by storage key (``known`` units kept, their
        ``ds_ids`` found again); ``only_ids``: only those holding the state of these parameters."""
        found: Dict[int, OffloadUnit] = {}
        # An offloaded unit's device storage is empty and cannot be viewed: the stage hands out
        # views of its host copy (``locate``), recognised here by the host buffer.
        by_host = {compat.storage_id(u.host): u for u in known.values() if u.on_host}
        with self._searching():
            for shard in self.shards:
                if only_ids is not None and shard.ds_id not in only_ids:
                    continue
                n = shard.local.numel()
                if n == 0:
                    continue
                for what, t in self._offloadable(shard, n):
                    unit = by_host.get(compat.storage_id(t))
                    if unit is None:
                        if t.device != self.device:
                            continue
                        key = compat.storage_id(t)
                        unit = found.get(key) or known.get(key)
                    if unit is None:
                        storage = t.untyped_storage()
                        view = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
                        unit = OffloadUnit(key, what, [], view, storage.nbytes())
                    key = unit.storage_key
                    if key not in found:
                        unit.ds_ids = []
                        found[key] = unit
                    unit.ds_ids.append(shard.ds_id)
        return found

    def _offloadable(self, shard: Any, n: int) -> List[Any]:
        tensors = []
        if self.sharding.masters_offloadable:
            tensors.append((MASTER, shard.local))
        for key, value in self.sharding.shard_optimizer_state(shard.ds_id).items():
            # Per-element state only (a view lined up with the shard); scalars such as Adam's
            # step stay where they are.
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == n:
                tensors.append((key, value))
        return tensors

    def device_master_bytes(self) -> int:
        """Bytes of the distinct master storages on the device (before any unit is found)."""
        seen = {}
        for shard in self.shards:
            t = shard.local
            if t.numel() and t.device == self.device:
                seen[compat.storage_id(t)] = t.untyped_storage().nbytes()
        return sum(seen.values())


def label(unit: OffloadUnit, param_names: Dict[int, str]) -> str:
    """``unit`` in words, for reports and errors."""
    names = [param_names.get(i, str(i)) for i in unit.ds_ids]
    of = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} parameters)"
    return f"{unit.what} of {of}"


def assign_placements(units: List[OffloadUnit], offloaded: Callable[[OffloadUnit], bool],
                      is_master_shard: Callable[[OffloadUnit], bool], headroom: Optional[int]) -> None:
    """Set each unit's placement from the plan's decision; offloaded optimizer state (not a
    master shard, which the backward's gathers read from the host anyway) is reloaded from the
    start of the boundary backward while ``headroom`` bytes (None: no budget, none) allow, in
    reload order."""
    left = 0 if headroom is None else headroom
    for unit in units:
        if not offloaded(unit):
            unit.placement = Placement.RESIDENT
        elif left >= unit.nbytes and not is_master_shard(unit):
            unit.placement = Placement.OFFLOADED_EARLY
            left -= unit.nbytes
        else:
            unit.placement = Placement.OFFLOADED
