"""Optimizer-state offload: the optimizer's per-element state (Adam's moments) and, under ZeRO-1/2,
the fp32 master partitions live in host memory between optimizer steps, as far as the plan says.

This module sequences the offload through the step, takes the plan's decisions and serves the
state between steps; its parts live beside it:

* ``units.py``: what moves (a whole device *storage*: optimizer state, a ZeRO-1/2 master partition,
  with parameter offload a ZeRO-3 master shard), its state (two enums: the plan's ``Placement``
  and the values' ``Residence``) and how units are found through the stage's ``Sharding``
  interface, so no stage's layout is known here;
* ``unit_copies.py``: the copies between the device and the host buffers, and the buffers;
* ``plan.py``: the arithmetic of the plan (``joint.py`` when other kinds are offloaded too).

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
* ``after_step()``: each unit the plan offloads and still on the device is copied to the host on
  the offload lane, ordered after the step, and its device storage is freed at once (the allocator
  is told the offload lane still reads it), so the copy overlaps the next forward. A unit nothing
  wrote since it came back (a frozen parameter's shard) is freed without a copy: its host copy is
  current (``Residence.DEVICE_HOST_CURRENT``).

Between steps the state is read and written where it is (``Sharding.state_access`` is this
object): ``locate`` hands the stage a view of an offloaded unit's host buffer once no copy into or
out of it is in flight, so checkpoints, full state dicts and weight export or loading never bring
units back; ``state_replaced`` takes over fresh state (``reset_optimizer_state``: checkpoint
loading) and sends it to the host one unit at a time where its predecessor was offloaded.

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

from deepcompile import compat
from deepcompile.offload import bandwidth, device_memory, host_memory
from deepcompile.offload.plan import OffloadPlan, check_budget, plan_offload
from deepcompile.offload.settings import OptStateOffloadSettings
from deepcompile.offload.unit_copies import UnitCopies
from deepcompile.offload.units import (MASTER, OffloadUnit, Placement, UnitFinder, UnitTable,  # noqa: F401
                                       assign_placements, label)


class OptimizerStateOffload:
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
        self.plan: Optional[OffloadPlan] = None
        self.planned_at_step: Optional[int] = None
        self.steps = 0
        # Measured at the first optimizer step (before it): see plan.py.
        self.peak_without: Optional[int] = None
        self.step_floor: Optional[int] = None
        self._other_at_step = 0
        self._stepped_ids: set = set()
        self._new_ids = True  # the first step plans
        # State storages replaced since the last step (reset_optimizer_state: checkpoint loading):
        # the next streamed step discovers its sub-groups' units again.
        self._replaced = False
        self._unplanned = False  # units taken over by state_replaced without a place in the plan
        sharding.state_access = self  # shards() etc. read offloaded units in their host copies
        # ZeRO-3 steps in sub-groups and lets the step stream through these hooks.
        self.streams = getattr(sharding, "stage", None) == 3
        if self.streams:
            sharding.sub_group_hooks = self
        self._groups: List[List[int]] = []  # the sub-groups of the last streamed step
        self._planned_keys: set = set()  # units the last plan covered
        self._peak_at_plan = 0
        self._masters_before_plan: Optional[int] = None
        # offload/joint.py: set by JointOffload when one plan covers this and the other kinds.
        self.joint: Optional[Any] = None
        self.finder = UnitFinder(sharding, device)
        if settings.offload_masters and self.streams:
            self._offload_masters_at_start()

    # ---- units --------------------------------------------------------------------------------

    @property
    def units(self) -> Dict[int, OffloadUnit]:
        """The known units by storage key."""
        return self.table.by_key

    def _discover(self, only_ids: Optional[set] = None) -> Dict[int, OffloadUnit]:
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
        self._take_provisionally(u for u in self._discover().values() if u.what == MASTER)
        failure = self.copies.take_failure()
        (failed,) = self.max_over_ranks([float(failure is not None)])
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
            resident = sum(u.nbytes for u in self._discover().values() if not u.on_host)
            self.peak_without = max(0, device_memory.peak_allocated(self.device) - resident)
            # Memory the step needs besides the offloadable tensors (gradients, parameters...).
            self._other_at_step = max(0, device_memory.allocated(self.device) - resident)
        # A parameter reduced for the first time gets its state at this step, on every rank alike
        # (reductions are collective): the plan is then redone together (after_step).
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
        self._groups = groups
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
        if self._new_ids or self._replaced:
            self._take_provisionally([u for u in self._discover(set(ids)).values()
                                      if u.storage_key not in self.units])
        for ds_id in ids:
            for unit in self.table.of(ds_id):
                # Master shards (parameter offload) go at after_step: until then the stage hands
                # them out as views (``shards()``), which an emptied storage cannot give.
                if unit.planned_out and unit.what != MASTER:
                    self.copies.offload(unit)

    def after_step(self) -> None:
        """Write back what the plan offloads; the next forward overlaps the copies."""
        self.steps += 1
        self.copies.releases.poll()
        found = self._discover()
        unplanned, self._unplanned, self._replaced = self._unplanned, False, False
        if self._new_ids:
            self._replan(found, collective=True)
            self._new_ids = False
        elif unplanned or found.keys() != self.units.keys():
            # Storages replaced outside a step (e.g. the optimizer's state loaded from a checkpoint).
            self._replan(found, collective=False)
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
        """Bring every offloaded unit back to the device; they stay until the next after_step."""
        if self.finder.finding:
            return
        for unit in self.units.values():
            self.copies.reload(unit)
        for unit in self.units.values():
            self.copies.arrived(unit)

    # ---- reading and writing state between steps (Sharding.state_access) -----------------------

    def locate(self, t: torch.Tensor) -> torch.Tensor:
        """See ``zero/sharding.py``'s ``StateAccess``: an offloaded unit is read and written in
        its host buffer (checkpoints, weight export and loading), never brought back for it."""
        unit = self.units.get(compat.storage_id(t))
        if unit is None:
            return t
        finding = self.finder.finding  # (a search only takes views: no copy needs to be complete)
        if not finding:
            self.copies.settle(unit)
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
        ids = set(ds_ids)
        old = {u.storage_key: u for i in ids for u in self.table.of(i) if u.what != MASTER}
        previous = {}
        for unit in old.values():
            self.copies.settle(unit)  # its host buffer may be handed on
            previous[(unit.what, tuple(sorted(unit.ds_ids)))] = unit
        self.table.remove(set(old), ids)
        for key, unit in self._discover(ids).items():
            if key in self.units or unit.what == MASTER:
                # Masters are written in place, never replaced (and one not yet known is left to the
                # next step's plan: views of it are held by the caller).
                continue
            self.table.add(unit)
            prev = previous.get((unit.what, tuple(sorted(unit.ds_ids))))
            if prev is not None and prev.nbytes == unit.nbytes:
                unit.host, unit.placement = prev.host, prev.placement
                if prev.storage_key in self._planned_keys:
                    self._planned_keys.discard(prev.storage_key)
                    self._planned_keys.add(key)
            else:
                offload = self.settings.offload_state and self.copies.ensure_host(unit)
                unit.placement = Placement.OFFLOADED if offload else Placement.RESIDENT
                self._unplanned = True  # not in the plan: the next step's plan takes it in
            if unit.planned_out:
                self.copies.offload(unit)
                self.copies.settle(unit)  # its device memory is free before the next fresh state
        self._replaced = self._replaced or bool(old)

    # ---- planning -----------------------------------------------------------------------------

    def _replan(self, found: Dict[int, OffloadUnit], collective: bool) -> None:
        new_bytes = sum(u.nbytes for k, u in found.items() if k not in self._planned_keys)
        if self.streams:
            # A streamed step holds its other memory plus two sub-groups' state at a time (the
            # resident units come on top, as in the forward: plan.py).
            self.step_floor = self._other_at_step + self._window_bytes(found)
        elif self.step_floor is None:
            # The step needs its other memory plus every offloadable tensor, all reloaded.
            self.step_floor = self._other_at_step + sum(u.nbytes for u in found.values())
        else:
            self.step_floor += new_bytes
        self.table.replace_all(found)
        self._planned_keys = set(found)
        ordered = self.table.in_reload_order()
        peak_without, step_floor = self.peak_without, self.step_floor
        joint = self.joint
        if collective:
            # One plan decision for all ranks: the largest measurement, so every rank raises alike.
            peak_without, step_floor = self.max_over_ranks([peak_without, step_floor])
            self.peak_without, self.step_floor = peak_without, step_floor
            check_budget(self.settings.budget_bytes, self.settings.budget_name, peak_without, step_floor)
        budget = self.settings.budget_bytes
        # Resident units occupy the device through the forward/backward and, when the step streams,
        # through the step as well.
        keep_limit = None if budget is None else budget - (max(peak_without, step_floor) if self.streams
                                                             else peak_without)
        # Under ZeRO-3 a master unit is a parameter shard (parameter offload's kind); under
        # ZeRO-1/2 a master partition is optimizer state like Adam's moments.
        shard = [self.is_master_shard(u) for u in ordered]
        eligible = [self.settings.offload_masters if p else self.settings.offload_state for p in shard]
        forced = [p and self.settings.force_masters for p in shard]
        self.plan = plan_offload([u.nbytes for u in ordered], keep_limit, self.settings.min_fraction, forced,
                                 eligible, priority=[int(p) for p in shard])
        self.planned_at_step = self.steps
        self._peak_at_plan = device_memory.peak_allocated(self.device)
        decided = {u.storage_key: out for u, out in zip(ordered, self.plan.offloaded)}
        assign_placements(ordered, lambda u: decided[u.storage_key], self.is_master_shard,
                          None if keep_limit is None else keep_limit - self.plan.resident_bytes)
        failure = None
        if joint is None or not collective:  # (with a joint plan its decision, below, gets host buffers)
            for unit in ordered:
                if unit.planned_out and not self.copies.ensure_host(unit):
                    break
            failure = self.copies.take_failure()
        if joint is not None and collective:
            # The units' decisions are made again together with the activations' (the same
            # measurements, all-reduced there); host buffers for what it offloads are ensured.
            failure = failure or joint.replan("optimizer state planned after step " + str(self.steps), vote=False)
        failure = failure or self.copies.take_failure()
        failed = float(failure is not None)
        if collective:
            (failed,) = self.max_over_ranks([failed])
        if failed:
            raise host_memory.PinnedMemoryError(
                "optimizer-state offload (" + self.settings.enabled_by + ") could not allocate its host buffers"
                + (f" on this rank ({failure})" if failure else " on another rank")
                + (f"; {self.plan.offloaded_bytes} bytes were to be offloaded. Lower what is offloaded "
                   "(offload_optimizer.ratio, a larger compile.memory_budget_*), free host memory"
                   + (", or set offload_optimizer.pin_memory false" if self.settings.pin_memory else "")))

    def joint_units(self) -> List[OffloadUnit]:
        """The planned units in reload order (the joint plan's candidates of this side)."""
        return self.table.in_reload_order()

    def is_master_shard(self, unit: OffloadUnit) -> bool:
        """Under ZeRO-3 a master unit is a parameter shard (parameter offload's kind, read by every
        gather); under ZeRO-1/2 a master partition is optimizer state like Adam's moments."""
        return self.streams and unit.what == MASTER

    def resident_offloadable_bytes(self) -> int:
        """Bytes of the units on the device now. Before the first plan under ZeRO-1/2 the units are
        not discovered yet; the master partitions, on the device then, are counted from the shards."""
        if self.units:
            return sum(u.nbytes for u in self.units.values() if not u.on_host)
        if self.plan is not None or not self.sharding.masters_offloadable:
            return 0
        if self._masters_before_plan is None:
            self._masters_before_plan = self.finder.device_master_bytes()
        return self._masters_before_plan

    def apply_joint_plan(self, offloaded: Dict[int, bool], headroom: Optional[int]) -> Optional[str]:
        """Take the joint plan's decision per unit (storage key -> offloaded); reloads of offloaded
        optimizer state start in the backward as far as ``headroom`` (None: no budget) allows, as
        in ``_replan``. The copies happen at after_step. Returns why a host buffer could not be
        allocated on this rank (None: all were), for the caller's vote across ranks."""
        units = self.joint_units()
        assign_placements(units, lambda u: bool(offloaded.get(u.storage_key, u.planned_out)), self.is_master_shard,
                          headroom)
        out = [u.planned_out for u in units]
        moved = sum(u.nbytes for u in units if u.planned_out)
        required = self.plan.required_bytes if self.plan is not None else moved
        self.plan = OffloadPlan(out, sum(u.nbytes for u in units) - moved, moved, required)
        failed = any(u.planned_out and not self.copies.ensure_host(u) for u in units)  # stops at the first
        failure = self.copies.take_failure()  # (one noted earlier, e.g. by a streamed step, is superseded)
        return failure if failed else None

    def _window_bytes(self, found: Dict[int, OffloadUnit]) -> int:
        """The most state bytes two consecutive sub-groups of the last step hold."""
        per_id: Dict[int, int] = {}
        for unit in found.values():
            for ds_id in unit.ds_ids:
                per_id[ds_id] = per_id.get(ds_id, 0) + unit.nbytes // len(unit.ds_ids)
        sizes = [sum(per_id.get(i, 0) for i in ids) for ids in self._groups] or [0]
        return max(a + b for a, b in zip(sizes, sizes[1:] + [0]))

    def max_over_ranks(self, values: List[float]) -> List[int]:
        """The largest of each value over the ranks, as integers: one decision for every rank
        (collective; the joint plan agrees its measurements with it too)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in t.tolist()]

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
            "measured_peak_bytes": peak_now if plan and peak_now > self._peak_at_plan else None,
            "peak_at_plan_bytes": self._peak_at_plan if plan else None,
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
        if self.sharding.state_access is self:
            self.sharding.state_access = None
        for unit in self.units.values():
            unit.host = None
        self.table.clear()
