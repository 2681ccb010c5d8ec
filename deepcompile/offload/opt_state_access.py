"""Reading and writing offloaded optimizer state where it is (``Sharding.state_access`` is this
object, see ``zero/sharding.py``'s ``StateAccess``), and bringing it all back.

Between steps, ``locate`` hands the stage a view of an offloaded unit's host buffer once no copy
into or out of it is in flight, so checkpoints, full state dicts and weight export or loading
never bring units back; ``state_replaced`` takes over fresh state (``reset_optimizer_state``:
checkpoint loading) and sends it to the host one unit at a time where its predecessor was
offloaded. The units and their copies are the offload object's (``opt_states.py``).
"""

from __future__ import annotations

from typing import Any, List

import torch

from deepcompile import compat
from deepcompile.offload.units import MASTER, Placement


class OffloadedStateAccess:
    """``offload``: the ``OptimizerStateOffload`` whose units are read and written."""

    def __init__(self, offload: Any):
        self.offload = offload

    def materialize(self) -> None:
        """Bring every offloaded unit back to the device; they stay until the next after_step."""
        off = self.offload
        if off.finder.finding:
            return
        for unit in off.units.values():
            off.copies.reload(unit)
        for unit in off.units.values():
            off.copies.arrived(unit)

    def locate(self, t: torch.Tensor) -> torch.Tensor:
        """See ``zero/sharding.py``'s ``StateAccess``: an offloaded unit is read and written in
        its host buffer (checkpoints, weight export and loading), never brought back for it."""
        off = self.offload
        unit = off.units.get(compat.storage_id(t))
        if unit is None:
            return t
        finding = off.finder.finding  # (a search only takes views: no copy needs to be complete)
        if not finding:
            off.copies.settle(unit)
        if not unit.on_host:
            if not finding:
                unit.device_written()  # the caller may write the device copy
            return t
        return unit.host.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

    def state_replaced(self, ds_ids: List[int]) -> None:
        """See ``StateAccess``. The fresh state of a parameter whose previous state was planned
        out takes its place in the plan (and its host buffer) and goes to the host now; state
        that had no predecessor is offloaded provisionally, as state created by a streamed step,
        until the plan after the next step decides. Either way the fresh state of ``ds_ids`` is
        the only fresh state on the device beyond what the plan keeps resident."""
        off = self.offload
        ids = set(ds_ids)
        old = {u.storage_key: u for i in ids for u in off.table.of(i) if u.what != MASTER}
        previous = {}
        for unit in old.values():
            off.copies.settle(unit)  # its host buffer may be handed on
            previous[(unit.what, tuple(sorted(unit.ds_ids)))] = unit
        off.table.remove(set(old), ids)
        for key, unit in off.discover(ids).items():
            if key in off.units or unit.what == MASTER:
                # Masters are written in place, never replaced (and one not yet known is left to the
                # next step's plan: views of it are held by the caller).
                continue
            off.table.add(unit)
            prev = previous.get((unit.what, tuple(sorted(unit.ds_ids))))
            if prev is not None and prev.nbytes == unit.nbytes:
                unit.host, unit.placement = prev.host, prev.placement
                if prev.storage_key in off.planned_keys:
                    off.planned_keys.discard(prev.storage_key)
                    off.planned_keys.add(key)
            else:
                offload = off.settings.offload_state and off.copies.ensure_host(unit)
                unit.placement = Placement.OFFLOADED if offload else Placement.RESIDENT
                off.unplanned = True  # not in the plan: the next step's plan takes it in
            if unit.planned_out:
                off.copies.offload(unit)
                off.copies.settle(unit)  # its device memory is free before the next fresh state
        off.replaced = off.replaced or bool(old)
