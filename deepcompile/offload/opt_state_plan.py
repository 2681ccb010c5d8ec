"""Optimizer-state offload's planning side: its units as one side of the memory planner
(``sides.py``'s protocol, driven by ``joint.py``), the measurements it offers, and the plan of
its units alone (``plan.py``), which the joint plan then refines.

The state the step sequencing keeps (``opt_states.py``: the unit table, the copies, the measured
floors) is the offload object's; this module reads it and writes the plan's decisions into it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from deepcompile.offload import device_memory, host_memory
from deepcompile.offload.joint_plan import MASTER as MASTER_KIND
from deepcompile.offload.joint_plan import OPTIMIZER_STATE, Candidate
from deepcompile.offload.plan import OffloadPlan, check_budget, plan_offload
from deepcompile.offload.ranks import max_over_ranks
from deepcompile.offload.sides import Floors, Share
from deepcompile.offload.units import MASTER, OffloadUnit, assign_placements


@dataclasses.dataclass(frozen=True)
class StateChange:
    """What an optimizer step did to the offloadable state, as the step sequencing found it
    (``OptimizerStateOffload.after_step``): ``found``: the units now, by storage key;
    ``created``: the step created state (a parameter stepped for the first time, on every rank
    alike: reductions are collective); ``replaced``: storages were replaced outside a step (the
    optimizer's state loaded from a checkpoint), on this rank."""

    found: Dict[int, OffloadUnit]
    created: bool
    replaced: bool


class UnitSide:
    """Optimizer state and, with parameter offload, the ZeRO-3 master shards, as one side of the
    planner. ``offload``: the ``OptimizerStateOffload`` whose units these are."""

    name = "optimizer_state"

    def __init__(self, offload: Any):
        self.offload = offload
        self._units: List[OffloadUnit] = []

    # ---- what the planner reads ---------------------------------------------------------------

    @property
    def streams(self) -> bool:
        """The step streams in ZeRO-3 sub-groups: resident units count against its peak too."""
        return self.offload.streams

    @property
    def steps(self) -> int:
        """Optimizer steps done."""
        return self.offload.steps

    @property
    def min_state_fraction(self) -> float:
        """The least share of optimizer state offloaded whatever the budget (``offload_optimizer.ratio``)."""
        return self.offload.settings.min_fraction

    def floors(self) -> Floors:
        return Floors(self.offload.peak_without or 0, self.offload.step_floor or 0)

    def resident_bytes(self) -> int:
        """Bytes of the units on the device now. Before the first plan under ZeRO-1/2 the units are
        not discovered yet; the master partitions, on the device then, are counted from the shards."""
        off = self.offload
        if off.units:
            return sum(u.nbytes for u in off.units.values() if not u.on_host)
        if off.plan is not None or not off.sharding.masters_offloadable:
            return 0
        if off.masters_before_plan is None:
            off.masters_before_plan = off.finder.device_master_bytes()
        return off.masters_before_plan

    def is_master_shard(self, unit: OffloadUnit) -> bool:
        """Under ZeRO-3 a master unit is a parameter shard (parameter offload's kind, read by every
        gather); under ZeRO-1/2 a master partition is optimizer state like Adam's moments."""
        return self.offload.streams and unit.what == MASTER

    def candidates(self) -> List[Candidate]:
        settings = self.offload.settings
        self._units = self.offload.table.in_reload_order()
        cands = []
        for u in self._units:
            master = self.is_master_shard(u)
            cands.append(Candidate(("unit", u.storage_key), MASTER_KIND if master else OPTIMIZER_STATE, u.nbytes,
                                   forced=master and settings.force_masters,
                                   eligible=settings.offload_masters if master else settings.offload_state))
        return cands

    def apply(self, share: Share) -> Optional[str]:
        """Take the plan's decision per unit; reloads of offloaded optimizer state start in the
        backward as far as the headroom (None: no budget) allows, as in :meth:`plan_units`. The
        copies happen at the step's write-back."""
        off = self.offload
        units = off.table.in_reload_order()
        assign_placements(units, lambda u: bool(share.decided.get(("unit", u.storage_key), u.planned_out)),
                          self.is_master_shard, share.headroom)
        out = [u.planned_out for u in units]
        moved = sum(u.nbytes for u in units if u.planned_out)
        required = off.plan.required_bytes if off.plan is not None else moved
        off.plan = OffloadPlan(out, sum(u.nbytes for u in units) - moved, moved, required)
        failed = any(u.planned_out and not off.copies.ensure_host(u) for u in units)  # stops at the first
        failure = off.copies.take_failure()  # (one noted earlier, e.g. by a streamed step, is superseded)
        return failure if failed else None

    # ---- the units' own plan ------------------------------------------------------------------

    def plan_units(self, found: Dict[int, OffloadUnit], agree: bool) -> None:
        """Take ``found`` as the units and plan them alone (``plan.py``): their placements and the
        early reloads. ``agree``: the floors are agreed over the ranks first and a budget no plan
        meets is raised (collective); host buffers are then the planner's to ensure."""
        off = self.offload
        new_bytes = sum(u.nbytes for k, u in found.items() if k not in off.planned_keys)
        if off.streams:
            # A streamed step holds its other memory plus two sub-groups' state at a time (the
            # resident units come on top, as in the forward: plan.py).
            off.step_floor = off.other_at_step + self._window_bytes(found)
        elif off.step_floor is None:
            # The step needs its other memory plus every offloadable tensor, all reloaded.
            off.step_floor = off.other_at_step + sum(u.nbytes for u in found.values())
        else:
            off.step_floor += new_bytes
        off.table.replace_all(found)
        off.planned_keys = set(found)
        ordered = off.table.in_reload_order()
        peak_without, step_floor = off.peak_without, off.step_floor
        settings = off.settings
        if agree:
            # One plan decision for all ranks: the largest measurement, so every rank raises alike.
            peak_without, step_floor = max_over_ranks([peak_without, step_floor], off.device, off.group)
            off.peak_without, off.step_floor = peak_without, step_floor
            check_budget(settings.budget_bytes, settings.budget_name, peak_without, step_floor)
        budget = settings.budget_bytes
        # Resident units occupy the device through the forward/backward and, when the step streams,
        # through the step as well.
        keep_limit = None if budget is None else budget - (max(peak_without, step_floor) if off.streams
                                                             else peak_without)
        # Under ZeRO-3 a master unit is a parameter shard (parameter offload's kind); under
        # ZeRO-1/2 a master partition is optimizer state like Adam's moments.
        shard = [self.is_master_shard(u) for u in ordered]
        eligible = [settings.offload_masters if p else settings.offload_state for p in shard]
        forced = [p and settings.force_masters for p in shard]
        off.plan = plan_offload([u.nbytes for u in ordered], keep_limit, settings.min_fraction, forced,
                                eligible, priority=[int(p) for p in shard])
        off.planned_at_step = off.steps
        off.peak_at_plan = device_memory.peak_allocated(off.device)
        decided = {u.storage_key: out for u, out in zip(ordered, off.plan.offloaded)}
        assign_placements(ordered, lambda u: decided[u.storage_key], self.is_master_shard,
                          None if keep_limit is None else keep_limit - off.plan.resident_bytes)

    def ensure_host_buffers(self) -> Optional[str]:
        """Host buffers for every unit the plan offloads; why one could not be allocated on this
        rank (None: all were)."""
        copies = self.offload.copies
        for unit in self.offload.table.in_reload_order():
            if unit.planned_out and not copies.ensure_host(unit):
                break
        return copies.take_failure()

    def take_failure(self) -> Optional[str]:
        """A host-buffer failure noted since the last one taken (None: none)."""
        return self.offload.copies.take_failure()

    def host_buffer_error(self, failure: Optional[str]) -> host_memory.PinnedMemoryError:
        """The error every rank raises when a host buffer of the plan could not be allocated
        (``failure``: why on this rank; None: on another)."""
        off = self.offload
        settings = off.settings
        return host_memory.PinnedMemoryError(
            "optimizer-state offload (" + settings.enabled_by + ") could not allocate its host buffers"
            + (f" on this rank ({failure})" if failure else " on another rank")
            + (f"; {off.plan.offloaded_bytes} bytes were to be offloaded. Lower what is offloaded "
               "(offload_optimizer.ratio, a larger compile.memory_budget_*), free host memory"
               + (", or set offload_optimizer.pin_memory false" if settings.pin_memory else "")))

    def _window_bytes(self, found: Dict[int, OffloadUnit]) -> int:
        """The most state bytes two consecutive sub-groups of the last step hold."""
        per_id: Dict[int, int] = {}
        for unit in found.values():
            for ds_id in unit.ds_ids:
                per_id[ds_id] = per_id.get(ds_id, 0) + unit.nbytes // len(unit.ds_ids)
        sizes = [sum(per_id.get(i, 0) for i in ids) for ids in self.offload.groups] or [0]
        return max(a + b for a, b in zip(sizes, sizes[1:] + [0]))
