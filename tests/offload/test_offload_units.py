"""Offload units alone (deepcompile/offload/units.py, unit_copies.py): a unit's state is two enums
that change only through the copies, and the plan's decisions become placements. On a CPU device
the copies are synchronous, so every transition is exact here."""

from __future__ import annotations

import torch

from deepcompile.offload.unit_copies import UnitCopies
from deepcompile.offload.units import MASTER, OffloadUnit, Placement, Residence, assign_placements


def _unit(values: torch.Tensor, key: int = 1, ds_ids=(0,), what: str = "exp_avg") -> OffloadUnit:
    storage = values.untyped_storage()
    view = torch.empty(0, dtype=torch.uint8).set_(storage)
    return OffloadUnit(key, what, list(ds_ids), view, storage.nbytes())


def _copies():
    return UnitCopies(torch.device("cpu"), pin_memory=False, offload_masters=False, label=lambda u: u.what)


def test_a_unit_goes_to_the_host_and_back_bitwise():
    values = torch.randn(16)
    expected = values.clone()
    unit, copies = _unit(values), _copies()
    assert unit.residence is Residence.DEVICE and not unit.host_current
    assert copies.ensure_host(unit)
    copies.offload(unit)
    assert unit.residence is Residence.HOST and unit.on_host and unit.host_current
    assert values.untyped_storage().nbytes() == 0  # the device storage is freed, the tensor kept
    copies.reload(unit)
    assert unit.residence is Residence.DEVICE_HOST_CURRENT and not unit.on_host
    assert torch.equal(values, expected)


def test_an_unchanged_unit_goes_back_without_a_copy_and_a_written_one_with_one():
    values = torch.randn(8)
    unit, copies = _unit(values), _copies()
    copies.ensure_host(unit)
    copies.offload(unit)
    copies.reload(unit)
    writes = []
    inner = copies.lanes.offload
    copies.lanes.offload = lambda host, dev: writes.append(1) or inner(host, dev)
    copies.offload(unit)  # host current: only the device storage goes
    assert writes == [] and unit.residence is Residence.HOST
    copies.reload(unit)
    values.add_(1.0)
    unit.device_written()
    assert unit.residence is Residence.DEVICE
    copies.offload(unit)
    assert writes == [1]
    copies.reload(unit)
    copies.release_host(unit)  # the plan keeps it: the buffer goes, the values stay
    assert unit.host is None and unit.residence is Residence.DEVICE and copies.host_bytes([unit]) == 0


def test_placements_follow_the_plan_and_the_headroom_in_reload_order():
    units = [_unit(torch.zeros(n), key=k, ds_ids=(10 - k,)) for k, n in ((1, 4), (2, 8), (3, 4))]
    units[2].what = MASTER
    nbytes = [u.nbytes for u in units]  # 16, 32, 16
    # Room for the first offloaded unit only; the master shard never reloads early.
    assign_placements(units, lambda u: u.storage_key != 2, lambda u: u.what == MASTER, headroom=nbytes[0])
    assert [u.placement for u in units] == [Placement.OFFLOADED_EARLY, Placement.RESIDENT, Placement.OFFLOADED]
    assert [u.planned_out for u in units] == [True, False, True] and [u.early for u in units] == [True, False, False]
    assign_placements(units, lambda u: True, lambda u: False, headroom=None)  # no budget: nothing early
    assert all(u.placement is Placement.OFFLOADED for u in units)
