"""Optimizer-state offload: the optimizer's per-element state (Adam's moments) and, under ZeRO-1/2,
the fp32 master partitions live in host memory between optimizer steps, as far as the plan says.

This module sequences the offload through the step and keeps its state (the units, the measured
floors, the plan); its other concepts live beside it:

* ``units.py``: what moves (a whole device *storage*: optimizer state, a ZeRO-1/2 master partition,
  with parameter offload a ZeRO-3 master shard), its state (two enums: the plan's ``Placement``
  and the values' ``Residence``) and how units are found through the stage's ``Sharding``
  interface, so no stage's layout is known here;
* ``unit_copies.py``: the copies between the device and the host buffers, and the buffers;
* ``opt_state_plan.py``: the planning side (``UnitSide``: its measurements, its candidates for the
  joint plan, the plan of its units alone, ``plan.py``'s arithmetic); when a plan is made is the
  memory planner's decision (``joint.py``), from what ``after_step`` found (``StateChange``);
* ``opt_state_access.py``: the state read and written where it is between steps.

A step (``Engine``):

* ``before_backward(boundary=True)``: the units the plan lets come back during the backward (the
  headroom the budget leaves above the measured forward/backward peak) start reloading on the
  reload lane, those of the last parameters first (their gradients are final first);
* ``before_step()``: under ZeRO-1/2 everything still on the host is reloaded; the compute stream
  waits for the reload copies (events, no host synchronisation) and the optimizer step runs on the
  device;
* under ZeRO-3 the step instead *streams* (``before_sub_group``/``after_sub_group``, called by the
  step in sub-groups of ``zero_optimization.sub_group_size``, zero/sub_groups.py): the next
  sub-group's units reload while this one steps, and each sub-group's offloaded units are written
  back as soon as it has stepped, so the step holds a window of two sub-groups of state, not all;
* ``after_step()`` finds what the step created or replaced, for the memory planner; then
  ``write_back()``: each unit the plan offloads and still on the device is copied to the host on
  the offload lane, ordered after the step, and its device storage is freed at once (the allocator
  is told the offload lane still reads it), so the copy overlaps the next forward. A unit nothing
  wrote since it came back (a frozen parameter's shard) is freed without a copy: its host copy is
  current (``Residence.DEVICE_HOST_CURRENT``).

Between steps the state is read and written where it is (``opt_state_access.py``, the stage's
``Sharding.state_access``).

Torch optimizers create their state at their first step: the first plan is made right after it,
from that step's measurements, and state first created later (a parameter whose first gradient
came later) is planned at the step that creates it. Before the first step nothing is offloaded.
When the step streams, state created by a sub-group is written back provisionally right after it
(the step could not hold all of it otherwise); what the plan then keeps resident comes back at
once, and its host buffer (as that of a master the plan keeps) is released (``host_release.py``).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from deepcompile.offload import bandwidth, device_memory, host_memory
from deepcompile.offload.opt_state_access import OffloadedStateAccess
from deepcompile.offload.opt_state_plan import StateChange, UnitSide
from deepcompile.offload.ranks import max_over_ranks
from deepcompile.offload.settings import OptStateOffloadSettings
from deepcompile.offload.unit_copies import UnitCopies
from deepcompile.offload.units import MASTER, OffloadUnit, Placement, UnitFinder, UnitTable, label


class OptimizerStateOffload:
    """The state of optimizer-state (and parameter) offload and its sequencing through the step.

    Fields the planning side (``opt_state_plan.py``) and the state access
    (``opt_state_access.py``) read and write too: ``table`` (the units), ``copies``, ``finder``,
    ``plan``, ``planned_at_step``, ``peak_without``/``step_floor``/``other_at_step`` (the
    floors, measured at the first step), ``groups`` (the last streamed step's sub-groups),
    ``planned_keys`` (the units the last plan covered), ``peak_at_plan``, ``unplanned``/
    ``replaced`` (what ``state_replaced`` did since the last step)."""

    def __init__(self, sharding, settings: OptStateOffloadSettings, device: torch.device,
                 group: Optional[dist.ProcessGroup], param_names: Dict[int, str]):
        self.sharding = sharding
        self.settings = settings
        self.device = device
        self.group = group
        self.param_names = param_names
        self.copies = UnitCopies(device, settings.pin_memory, settings.offload_masters, self._label)
        lanes = self.copies.lanes
        if settings.offload_masters and lanes.async_ and not lanes.shares_runtime_lanes:
            raise RuntimeError("parameter offload needs the deepcompile runtime initialized on " + str(device)
                               + ": its gathers order their reads of host shards after the runtime's offload lane")
        self.table = UnitTable()
        self.plan: Optional[Any] = None  # plan.py's OffloadPlan, once planned
        self.planned_at_step: Optional[int] = None
        self.steps = 0
        # Measured at the first optimizer step (before it): see plan.py.
        self.peak_without: Optional[int] = None
        self.step_floor: Optional[int] = None
        self.other_at_step = 0
        self._stepped_ids: set = set()
        self._new_ids = True  # the first step plans
        # State storages replaced since the last step (reset_optimizer_state: checkpoint loading):
        # the next streamed step discovers its sub-groups' units again.
        self.replaced = False
        self.unplanned = False  # units taken over by state_replaced without a place in the plan
        self.access = OffloadedStateAccess(self)
        sharding.state_access = self.access  # shards() etc. read offloaded units in their host copies
        # ZeRO-3 steps in sub-groups and lets the step stream through these hooks.
        self.streams = getattr(sharding, "stage", None) == 3
        if self.streams:
            sharding.sub_group_hooks = self
        self.groups: List[List[int]] = []  # the sub-groups of the last streamed step
        self.planned_keys: set = set()  # units the last plan covered
        self.peak_at_plan = 0
        self.masters_before_plan: Optional[int] = None
        self.finder = UnitFinder(sharding, device)
        # The planning side: what the memory planner (joint.py) weighs and decides for.
        self.side = UnitSide(self)
        if settings.offload_masters and self.streams:
            self._offload_masters_at_start()

    # ---- units --------------------------------------------------------------------------------

    @property
    def units(self) -> Dict[int, OffloadUnit]:
        """The known units by storage key."""
        return self.table.by_key

    def discover(self, only_ids: Optional[set] = None) -> Dict[int, OffloadUnit]:
        """The units the stage holds now (of ``only_ids``' parameters), known ones as they are."""
        return self.finder.find(self.table.by_key, only_ids)

    def _take_provisionally(self, units) -> None:
        """Units found outside a plan (parameter offload's masters at the start, state a streamed
        step just created) are known from now on and go to the host until the next plan decides."""
        for unit in units:
            self.table.add(unit)
            if self.copies.ensure_host(unit):
                unit.placement = Placement.OFFLOADED  # provisional: the plan at after_step decides

    def _offload_masters_at_start(self) -> None:
        """Parameter offload starts before the first forward: a model that fits only with its
        masters on the host must run from its first step, before any measurement (as DeepSpeed
        offloads activations before profiling). The plan made after the first step brings back
        the masters it keeps resident. Collective: a host buffer that cannot be allocated on one
        rank is raised on every rank."""
        self._take_provisionally(u for u in self.discover().values() if u.what == MASTER)
        failure = self.copies.take_failure()
        (failed,) = max_over_ranks([float(failure is not None)], self.device, self.group)
        if failed:
            raise host_memory.PinnedMemoryError(
                "parameter offload (" + self.settings.enabled_by + ") could not allocate its host buffers"
                + (f" on this rank ({failure})" if failure else " on another rank")
                + "; free host memory" + (", or turn pin_memory off" if self.settings.pin_memory else ""))
        for unit in self.units.values():
            if unit.planned_out:
                self.copies.offload(unit)

    def _label(self, unit: OffloadUnit) -> str:
        return label(unit, self.param_names)

    # ---- the step -----------------------------------------------------------------------------

    def before_backward(self, boundary: bool) -> None:
        """Start the reloads that fit beside the backward (only at an accumulation boundary)."""
        self.copies.releases.poll()
        if not boundary:
            return
        for unit in self.table.in_reload_order():
            if unit.early:
                self.copies.reload(unit)

    def before_step(self) -> None:
        """Everything the step reads is on the device (the compute stream waits for it), or, when
        the step streams, will be brought in per sub-group."""
        from deepcompile import runtime

        self.copies.releases.poll()
        if self.peak_without is None:
            # First step: measure before any state exists (see plan.py); under ZeRO-1/2 the
            # masters are already there, and resident.
            resident = sum(u.nbytes for u in self.discover().values() if not u.on_host)
            self.peak_without = max(0, device_memory.peak_allocated(self.device) - resident)
            # Memory the step needs besides the offloadable tensors (gradients, parameters...).
            self.other_at_step = max(0, device_memory.allocated(self.device) - resident)
        # A parameter reduced for the first time gets its state at this step, on every rank alike
        # (reductions are collective): the planner then redoes the plan together (after_step).
        ids = {i for i in self.param_names if runtime.was_reduced(i)}
        if ids - self._stepped_ids:
            self._new_ids = True
            self._stepped_ids |= ids
        if not self.streams:
            self.materialize()
            for unit in self.units.values():
                unit.device_written()  # ZeRO-1/2 step every unit whole

    def before_sub_group(self, index: int, groups: List[List[int]]) -> None:
        """Sub-group ``index`` is about to step: its state is on the device for the compute
        stream, and the next sub-group's starts coming back (overlapping this one's step)."""
        self.groups = groups
        for ids in groups[index: index + 2]:
            for ds_id in ids:
                for unit in self.table.of(ds_id):
                    self.copies.reload(unit)
        for ds_id in groups[index]:
            for unit in self.table.of(ds_id):
                self.copies.arrived(unit)
                unit.device_written()  # the step updates it in place

    def after_sub_group(self, index: int, groups: List[List[int]]) -> None:
        """Sub-group ``index`` has stepped: write back what the plan offloads (state the step
        just created: all of it, until the plan after this step says what stays)."""
        ids = groups[index]
        # Only a step that creates state (parameters stepped for the first time) or follows a
        # replacement of it has units to find; views of every parameter's state at every step
        # cost milliseconds per 7B step on the host.
        if self._new_ids or self.replaced:
            self._take_provisionally([u for u in self.discover(set(ids)).values()
                                      if u.storage_key not in self.units])
        for ds_id in ids:
            for unit in self.table.of(ds_id):
                # Master shards (parameter offload) go at after_step: until then the stage hands
                # them out as views (``shards()``), which an emptied storage cannot give.
                if unit.planned_out and unit.what != MASTER:
                    self.copies.offload(unit)

    def after_step(self) -> StateChange:
        """The step is done: count it and find what it created or replaced. The memory planner
        (``joint.py``) decides from this whether the plan is redone; ``write_back`` follows."""
        self.steps += 1
        self.copies.releases.poll()
        found = self.discover()
        unplanned, self.unplanned, self.replaced = self.unplanned, False, False
        # Storages replaced outside a step (e.g. the optimizer's state loaded from a checkpoint)
        # matter only when the step created none (a plan for created state covers them).
        replaced = not self._new_ids and (unplanned or found.keys() != self.units.keys())
        return StateChange(found, self._new_ids, replaced)

    def write_back(self) -> None:
        """After the planner: write back what the plan offloads; the next forward overlaps the
        copies. What was written back provisionally and the plan keeps comes back now."""
        self._new_ids = False
        for unit in self.units.values():
            if unit.planned_out:
                self.copies.offload(unit)
            else:
                self.copies.reload(unit)  # written back provisionally, kept by the plan: comes back now
        for unit in self.units.values():
            if not unit.planned_out and unit.host is not None:
                self.copies.release_host(unit)

    def host_bytes(self) -> int:
        """Host memory held for offloaded state: the units' buffers, and those whose release waits
        for copies still reading them."""
        return self.copies.host_bytes(self.units.values())

    def materialize(self) -> None:
        """Bring every offloaded unit back to the device (``opt_state_access.py``)."""
        self.access.materialize()

    # ---- reporting and teardown ---------------------------------------------------------------

    def offloaded_units(self) -> List[OffloadUnit]:
        """Units whose device storage is freed right now."""
        return [u for u in self.units.values() if u.on_host]

    def report(self) -> Dict[str, Any]:
        plan = self.plan
        offloaded = plan.offloaded_bytes if plan else 0
        resident = plan.resident_bytes if plan else sum(u.nbytes for u in self.units.values())
        early = sum(u.nbytes for u in self.units.values() if u.early)
        link = bandwidth.copy_bandwidth(self.device) if plan and offloaded else None
        predicted_peak = None
        if plan and self.peak_without is not None and self.step_floor is not None:
            # The forward/backward holds the resident state and the early reloads; the step its
            # floor (plan.py) plus the resident state.
            predicted_peak = max(self.peak_without + resident + early, self.step_floor + resident)
        peak_now = device_memory.peak_allocated(self.device)
        return {
            "enabled_by": self.settings.enabled_by,
            "budget_bytes": self.settings.budget_bytes,
            "budget": self.settings.budget_name,
            "min_fraction": self.settings.min_fraction,
            "pinned": self.settings.pin_memory,
            "planned_after_step": self.planned_at_step,
            "peak_without_offloadable_bytes": self.peak_without,
            "step_floor_bytes": self.step_floor,
            "offloaded_bytes": offloaded,
            "resident_bytes": resident,
            "reloaded_during_backward_bytes": early,
            "host_buffer_bytes": self.host_bytes(),
            # Every offloaded byte goes to the host after a step and comes back for the next one.
            "copy_bandwidth": None if link is None else dataclasses.asdict(link),
            "predicted_transfer_s_per_step": None if link is None else link.seconds(offloaded, offloaded),
            "predicted_peak_bytes": predicted_peak,
            # The allocator's peak is never reset here (others read it): a peak above the one of
            # the plan's step happened since; otherwise it is at most that.
            "measured_peak_bytes": peak_now if plan and peak_now > self.peak_at_plan else None,
            "peak_at_plan_bytes": self.peak_at_plan if plan else None,
            "tensors": [{"tensor": self._label(u), "bytes": u.nbytes, "offloaded": u.planned_out,
                         "reload": "backward" if u.early else "before step" if u.planned_out else None}
                        for u in sorted(self.units.values(), key=lambda u: u.order_key)],
        }

    def close(self) -> None:
        """Bring the state back (the optimizer object may outlive the engine) and let go. State
        that cannot fit on the device any more (the reason it was offloaded: a 7B model's Adam
        state on one GPU) is not brought back; a warning says so, as it is lost with the engine."""
        away = sum(u.nbytes for u in self.units.values() if u.on_host)
        if away and not device_memory.fits(self.device, away):
            warnings.warn(f"optimizer-state offload: {away} bytes of optimizer state stay in host buffers that are "
                          "released with the engine (they no longer fit on the device); the optimizer object keeps "
                          "empty tensors for them. Save a checkpoint before destroy() to keep that state.",
                          stacklevel=3)
        else:
            self.materialize()
        self.copies.lanes.synchronize()
        self.copies.releases.drain()
        if self.sharding.state_access is self.access:
            self.sharding.state_access = None
        for unit in self.units.values():
            unit.host = None
        self.table.clear()
