"""Optimizer-state offload: the optimizer's per-element state (Adam's moments) and, under ZeRO-1/2,
the fp32 master partitions live in host memory between optimizer steps, as far as the plan says.

Units. What moves is a whole device *storage*: each state tensor the optimizer created for a
master (one per parameter under ZeRO-3, one per param group under ZeRO-1/2) and each ZeRO-1/2
master partition; with parameter offload, each ZeRO-3 master shard too (always offloaded, and
handed to the runtime as the gather source while on the host: ``_hand_gathers``). They are found
through the stage's ``Sharding`` interface (``shards()`` and ``shard_optimizer_state()``), so this
module knows no stage's layout. Offloading a unit copies its
bytes to a host buffer and frees the device storage (``resize_(0)``); the tensor objects the
optimizer holds stay the same, so the optimizer never notices. Reloading re-allocates the storage
in place and copies the bytes back: the values are bitwise those written.

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
  current (``OffloadUnit.host_current``).

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
from deepcompile.offload.host_release import HostReleases
from deepcompile.offload.lanes import CopyLanes
from deepcompile.offload.plan import OffloadPlan, check_budget, plan_offload
from deepcompile.offload.settings import OptStateOffloadSettings

MASTER = "fp32 master"


@dataclasses.dataclass(eq=False)
class OffloadUnit:
    """One device storage that may move to the host."""

    storage_key: int
    what: str  # MASTER or the optimizer's state key ("exp_avg", ...)
    ds_ids: List[int]  # the parameters whose state it holds
    device_bytes: torch.Tensor  # uint8 view of the whole device storage
    nbytes: int
    host: Optional[torch.Tensor] = None  # uint8 host buffer, allocated when first planned out
    planned_out: bool = False  # the plan keeps it on the host between steps
    early: bool = False  # reloaded from the start of the boundary backward
    on_host: bool = False  # the device storage is freed; the host copy holds the values
    written: Any = None  # completion of the last offload copy
    # The host buffer holds the device copy's values: nothing wrote the device copy since the last
    # copy between the two, so a write-back would move the same bytes again (``_offload`` skips it).
    host_current: bool = False
    reloading: Any = None  # completion of a reload copy the compute stream has not waited for yet

    @property
    def order_key(self) -> int:
        # Reload order: the parameters registered last are used last in the forward, so their
        # gradients are final first in the backward.
        return -max(self.ds_ids)


class OptimizerStateOffload:
    def __init__(self, sharding, settings: OptStateOffloadSettings, device: torch.device,
                 group: Optional[dist.ProcessGroup], param_names: Dict[int, str]):
        self.sharding = sharding
        self.settings = settings
        self.device = device
        self.group = group
        self.param_names = param_names
        self.lanes = CopyLanes(device)
        self.releases = HostReleases()  # host buffers of units the plan keeps resident
        if settings.offload_masters and self.lanes.async_ and not self.lanes.shares_runtime_lanes:
            raise RuntimeError("parameter offload needs the deepcompile runtime initialized on " + str(device)
                               + ": its gathers order their reads of host shards after the runtime's offload lane")
        self.units: Dict[int, OffloadUnit] = {}
        self.plan: Optional[OffloadPlan] = None
        self.planned_at_step: Optional[int] = None
        self.steps = 0
        self._discovering = False
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
        self._units_of: Dict[int, List[OffloadUnit]] = {}  # ds id -> units holding its state
        self._provisional_failure: Optional[str] = None
        self._planned_keys: set = set()  # units the last plan covered
        self._peak_at_plan = 0
        # The stage's shards, taken while all are on the device: the views stay valid (the same
        # storages are emptied and refilled in place), and an emptied one could not be viewed again.
        self._shards = list(sharding.shards())
        if settings.offload_masters and self.streams:
            self._offload_masters_at_start()

    # ---- units --------------------------------------------------------------------------------

    def _discover(self, only_ids: Optional[set] = None) -> Dict[int, OffloadUnit]:
        """The device storages that may move, by storage key (existing units kept); ``only_ids``:
        only those holding the state of these parameters."""
        found: Dict[int, OffloadUnit] = {}
        # An offloaded unit's device storage is empty and cannot be viewed: the stage hands out
        # views of its host copy (``locate``), recognised here by the host buffer.
        by_host = {compat.storage_id(u.host): u for u in self.units.values() if u.on_host}
        self._discovering = True
        try:
            for shard in self._shards:
                if only_ids is not None and shard.ds_id not in only_ids:
                    continue
                n = shard.local.numel()
                if n == 0:
                    continue
                tensors = []
                if self.sharding.masters_offloadable:
                    tensors.append((MASTER, shard.local))
                for key, value in self.sharding.shard_optimizer_state(shard.ds_id).items():
                    # Per-element state only (a view lined up with the shard); scalars such as
                    # Adam's step stay where they are.
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == n:
                        tensors.append((key, value))
                for what, t in tensors:
                    unit = by_host.get(compat.storage_id(t))
                    if unit is None:
                        if t.device != self.device:
                            continue
                        key = compat.storage_id(t)
                        unit = found.get(key) or self.units.get(key)
                    if unit is None:
                        storage = t.untyped_storage()
                        view = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
                        unit = OffloadUnit(key, what, [], view, storage.nbytes())
                    key = unit.storage_key
                    if key not in found:
                        unit.ds_ids = []
                        found[key] = unit
                    unit.ds_ids.append(shard.ds_id)
        finally:
            self._discovering = False
        return found

    def _offload_masters_at_start(self) -> None:
        """Parameter offload starts before the first forward: a model that fits only with its
        masters on the host must run from its first step, before any measurement (as DeepSpeed
        offloads activations before profiling). The plan made after the first step brings back
        the masters it keeps resident. Collective: a host buffer that cannot be allocated on one
        rank is raised on every rank."""
        for unit in self._discover().values():
            if unit.what != MASTER:
                continue
            self.units[unit.storage_key] = unit
            for ds_id in unit.ds_ids:
                self._units_of.setdefault(ds_id, []).append(unit)
            if self._ensure_host(unit):
                unit.planned_out = True  # provisional, like state created by a streamed step
        failure, self._provisional_failure = self._provisional_failure, None
        (failed,) = self._max_over_ranks([float(failure is not None)])
        if failed:
            raise host_memory.PinnedMemoryError(
                "parameter offload (" + self.settings.enabled_by + ") could not allocate its host buffers"
                + (f" on this rank ({failure})" if failure else " on another rank")
                + "; free host memory" + (", or turn pin_memory off" if self.settings.pin_memory else ""))
        for unit in self.units.values():
            if unit.planned_out:
                self._offload(unit)

    def _label(self, unit: OffloadUnit) -> str:
        names = [self.param_names.get(i, str(i)) for i in unit.ds_ids]
        of = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} parameters)"
        return f"{unit.what} of {of}"

    # ---- the step -----------------------------------------------------------------------------

    def before_backward(self, boundary: bool) -> None:
        """Start the reloads that fit beside the backward (only at an accumulation boundary)."""
        self.releases.poll()
        if not boundary:
            return
        for unit in sorted(self.units.values(), key=lambda u: u.order_key):
            if unit.early:
                self._reload(unit)

    def before_step(self) -> None:
        """Everything the step reads is on the device (the compute stream waits for it), or, when
        the step streams, will be brought in per sub-group."""
        from deepcompile import runtime

        self.releases.poll()
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
            for unit in self.units.values():
                unit.host_current = False  # ZeRO-1/2 step every unit whole
            self.materialize()

    def before_sub_group(self, index: int, groups: List[List[int]]) -> None:
        """Sub-group ``index`` is about to step: its state is on the device for the compute
        stream, and the next sub-group's starts coming back (overlapping this one's step)."""
        self._groups = groups
        ahead = groups[index: index + 2]
        for ids in ahead:
            for ds_id in ids:
                for unit in self._units_of.get(ds_id, ()):
                    self._reload(unit)
        for ds_id in groups[index]:
            for unit in self._units_of.get(ds_id, ()):
                self.lanes.wait(unit.reloading)
                unit.reloading = None
                self._hand_gathers(unit, to_host=False)
                unit.host_current = False  # the step updates it in place

    def after_sub_group(self, index: int, groups: List[List[int]]) -> None:
        """Sub-group ``index`` has stepped: write back what the plan offloads (state the step
        just created: all of it, until the plan after this step says what stays)."""
        ids = groups[index]
        # Only a step that creates state (parameters stepped for the first time) or follows a
        # replacement of it has units to find; views of every parameter's state at every step
        # cost milliseconds per 7B step on the host.
        discover = self._new_ids or self._replaced
        fresh = [u for u in self._discover(set(ids)).values() if u.storage_key not in self.units] if discover else []
        for unit in fresh:
            self.units[unit.storage_key] = unit
            for ds_id in unit.ds_ids:
                self._units_of.setdefault(ds_id, []).append(unit)
            if self._ensure_host(unit):
                unit.planned_out = True  # provisional: the plan at after_step decides
        for ds_id in ids:
            for unit in self._units_of.get(ds_id, ()):
                # Master shards (parameter offload) go at after_step: until then the stage hands
                # them out as views (``shards()``), which an emptied storage cannot give.
                if unit.planned_out and unit.what != MASTER:
                    self._offload(unit)

    def after_step(self) -> None:
        """Write back what the plan offloads; the next forward overlaps the copies."""
        self.steps += 1
        self.releases.poll()
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
                self._offload(unit)
            else:
                self._reload(unit)  # written back provisionally, kept by the plan: comes back now
        for unit in self.units.values():
            if not unit.planned_out and unit.host is not None:
                self._release_host(unit)

    def _release_host(self, unit: OffloadUnit) -> None:
        """``unit`` stays on the device: its host buffer goes (``host_release.py``), so host memory
        holds only offloaded units. A master's gathers read the device copy from now on. A later
        plan that offloads the unit again allocates a fresh buffer (``_ensure_host``)."""
        self.lanes.wait(unit.reloading)  # the compute stream (and the gathers after it) see the reload
        unit.reloading = None
        self._hand_gathers(unit, to_host=False)
        # Recorded after the hand-back: every read of the host copy was queued before these events.
        self.releases.release(unit.host, self.lanes.readers_done())
        unit.host, unit.written, unit.host_current = None, None, False

    def host_bytes(self) -> int:
        """Host memory held for offloaded state: the units' buffers, and those whose release waits
        for copies still reading them."""
        return sum(u.host.numel() for u in self.units.values() if u.host is not None) + self.releases.nbytes

    def materialize(self) -> None:
        """Bring every offloaded unit back to the device; they stay until the next after_step."""
        if self._discovering:
            return
        for unit in self.units.values():
            self._reload(unit)
        for unit in self.units.values():
            self.lanes.wait(unit.reloading)
            unit.reloading = None
            self._hand_gathers(unit, to_host=False)

    # ---- reading and writing state between steps (Sharding.state_access) -----------------------

    def locate(self, t: torch.Tensor) -> torch.Tensor:
        """See ``zero/sharding.py``'s ``StateAccess``: an offloaded unit is read and written in
        its host buffer (checkpoints, weight export and loading), never brought back for it."""
        unit = self.units.get(compat.storage_id(t))
        if unit is None:
            return t
        if not self._discovering:  # (discovery only takes views: no copy needs to be complete)
            self._settle(unit)
        if not unit.on_host:
            if not self._discovering:
                unit.host_current = False  # the caller may write the device copy
            return t
        return unit.host.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

    def _settle(self, unit: OffloadUnit) -> None:
        """No copy into or out of ``unit``'s host buffer is in flight: its offload is complete
        (a reader would see half-written bytes, a writer would be overwritten by the copy), and a
        reload of it is complete and its gathers point back at the device shard (a write to the
        device copy must be what the next gather reads). Host synchronisation: outside a step."""
        if unit.written is not None:
            unit.written.synchronize()
            unit.written = None
        if unit.reloading is not None:
            unit.reloading.synchronize()
            unit.reloading = None
            self._hand_gathers(unit, to_host=False)

    def state_replaced(self, ds_ids: List[int]) -> None:
        """See ``StateAccess``. The fresh state of a parameter whose previous state was planned
        out takes its place in the plan (and its host buffer) and goes to the host now; state
        that had no predecessor is offloaded provisionally, as state created by a streamed step,
        until the plan after the next step decides. Either way the fresh state of ``ds_ids`` is
        the only fresh state on the device beyond what the plan keeps resident."""
        ids = set(ds_ids)
        old = {u.storage_key: u for i in ids for u in self._units_of.get(i, ()) if u.what != MASTER}
        previous = {}
        for unit in old.values():
            self._settle(unit)  # its host buffer may be handed on
            self.units.pop(unit.storage_key, None)
            previous[(unit.what, tuple(sorted(unit.ds_ids)))] = unit
        for i in ids:
            if i in self._units_of:
                self._units_of[i] = [u for u in self._units_of[i] if u.storage_key not in old]
        for key, unit in self._discover(ids).items():
            if key in self.units or unit.what == MASTER:
                # Masters are written in place, never replaced (and one not yet known is left to the
                # next step's plan: views of it are held by the caller).
                continue
            self.units[key] = unit
            for ds_id in unit.ds_ids:
                self._units_of.setdefault(ds_id, []).append(unit)
            prev = previous.get((unit.what, tuple(sorted(unit.ds_ids))))
            if prev is not None and prev.nbytes == unit.nbytes:
                unit.host, unit.planned_out, unit.early = prev.host, prev.planned_out, prev.early
                if prev.storage_key in self._planned_keys:
                    self._planned_keys.discard(prev.storage_key)
                    self._planned_keys.add(key)
            else:
                unit.planned_out = self.settings.offload_state and self._ensure_host(unit)
                self._unplanned = True  # not in the plan: the next step's plan takes it in
            if unit.planned_out:
                self._offload(unit)
                self._settle(unit)  # its device memory is free before the next fresh state
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
        self.units = found
        self._planned_keys = set(found)
        self._units_of = {}
        for unit in found.values():
            for ds_id in unit.ds_ids:
                self._units_of.setdefault(ds_id, []).append(unit)
        ordered = sorted(found.values(), key=lambda u: u.order_key)
        peak_without, step_floor = self.peak_without, self.step_floor
        joint = getattr(self, "joint", None)  # offload/joint.py: one plan with the activations
        if collective:
            # One plan decision for all ranks: the largest measurement, so every rank raises alike.
            peak_without, step_floor = self._max_over_ranks([peak_without, step_floor])
            self.peak_without, self.step_floor = peak_without, step_floor
            check_budget(self.settings.budget_bytes, self.settings.budget_name, peak_without, step_floor)
        budget = self.settings.budget_bytes
        # Resident units occupy the device through the forward/backward and, when the step streams,
        # through the step as well.
        keep_limit = None if budget is None else budget - (max(peak_without, step_floor) if self.streams
                                                             else peak_without)
        # Under ZeRO-3 a master unit is a parameter shard (parameter offload's kind); under
        # ZeRO-1/2 a master partition is optimizer state like Adam's moments.
        shard = [self.streams and u.what == MASTER for u in ordered]
        eligible = [self.settings.offload_masters if p else self.settings.offload_state for p in shard]
        forced = [p and self.settings.force_masters for p in shard]
        self.plan = plan_offload([u.nbytes for u in ordered], keep_limit, self.settings.min_fraction, forced,
                                 eligible, priority=[int(p) for p in shard])
        self.planned_at_step = self.steps
        self._peak_at_plan = device_memory.peak_allocated(self.device)
        headroom = 0 if keep_limit is None else keep_limit - self.plan.resident_bytes
        failure = None
        for unit, out, master in zip(ordered, self.plan.offloaded, shard):
            unit.planned_out = out
            unit.early = False
            # (An offloaded master is read by the backward's gathers from the host anyway.)
            if out and headroom >= unit.nbytes and not master:
                unit.early = True  # fits beside the backward's peak: reload from its start
                headroom -= unit.nbytes
            # (With a joint plan its decision, below, is what gets host buffers.)
            if out and failure is None and (joint is None or not collective) and not self._ensure_host(unit):
                failure = self._provisional_failure
        if joint is not None and collective:
            # The units' decisions are made again together with the activations' (the same
            # measurements, all-reduced there); host buffers for what it offloads are ensured.
            failure = failure or joint.replan("optimizer state planned after step " + str(self.steps), vote=False)
        failure = failure or self._provisional_failure
        self._provisional_failure = None
        failed = float(failure is not None)
        if collective:
            (failed,) = self._max_over_ranks([failed])
        if failed:
            raise host_memory.PinnedMemoryError(
                "optimizer-state offload (" + self.settings.enabled_by + ") could not allocate its host buffers"
                + (f" on this rank ({failure})" if failure else " on another rank")
                + (f"; {self.plan.offloaded_bytes} bytes were to be offloaded. Lower what is offloaded "
                   "(offload_optimizer.ratio, a larger compile.memory_budget_*), free host memory"
                   + (", or set offload_optimizer.pin_memory false" if self.settings.pin_memory else "")))

    def joint_units(self) -> List[OffloadUnit]:
        """The planned units in reload order (the joint plan's candidates of this side)."""
        return sorted(self.units.values(), key=lambda u: u.order_key)

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
        if not hasattr(self, "_masters_before_plan"):
            seen = {}
            for shard in self._shards:
                t = shard.local
                if t.numel() and t.device == self.device:
                    seen[compat.storage_id(t)] = t.untyped_storage().nbytes()
            self._masters_before_plan = sum(seen.values())
        return self._masters_before_plan

    def apply_joint_plan(self, offloaded: Dict[int, bool], headroom: Optional[int]) -> Optional[str]:
        """Take the joint plan's decision per unit (storage key -> offloaded); reloads of offloaded
        optimizer state start in the backward as far as ``headroom`` (None: no budget) allows, as
        in ``_replan``. The copies happen at after_step. Returns why a host buffer could not be
        allocated on this rank (None: all were), for the caller's vote across ranks."""
        units = self.joint_units()
        left = 0 if headroom is None else headroom
        for unit in units:
            unit.planned_out = bool(offloaded.get(unit.storage_key, unit.planned_out))
            unit.early = False
            if unit.planned_out and not self.is_master_shard(unit) and left >= unit.nbytes:
                unit.early = True
                left -= unit.nbytes
        out = [u.planned_out for u in units]
        moved = sum(u.nbytes for u in units if u.planned_out)
        required = self.plan.required_bytes if self.plan is not None else moved
        self.plan = OffloadPlan(out, sum(u.nbytes for u in units) - moved, moved, required)
        failure = None
        for unit in units:
            if unit.planned_out and failure is None and not self._ensure_host(unit):
                failure = self._provisional_failure
        self._provisional_failure = None
        return failure

    def _ensure_host(self, unit: OffloadUnit) -> bool:
        """``unit`` has a host buffer (allocated now if needed); False (and the failure noted, to
        be raised on every rank by the next collective plan) when it cannot get one."""
        if unit.host is not None and unit.host.numel() == unit.nbytes:
            return True
        try:
            unit.host = host_memory.empty_host(unit.nbytes, self.settings.pin_memory)
            return True
        except host_memory.PinnedMemoryError as e:
            self._provisional_failure = self._provisional_failure or f"{self._label(unit)}: {e}"
            return False

    def _window_bytes(self, found: Dict[int, OffloadUnit]) -> int:
        """The most state bytes two consecutive sub-groups of the last step hold."""
        per_id: Dict[int, int] = {}
        for unit in found.values():
            for ds_id in unit.ds_ids:
                per_id[ds_id] = per_id.get(ds_id, 0) + unit.nbytes // len(unit.ds_ids)
        sizes = [sum(per_id.get(i, 0) for i in ids) for ids in self._groups] or [0]
        return max(a + b for a, b in zip(sizes, sizes[1:] + [0]))

    def _max_over_ranks(self, values: List[float]) -> List[int]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in t.tolist()]

    # ---- copies -------------------------------------------------------------------------------

    def _offload(self, unit: OffloadUnit) -> None:
        if unit.on_host:
            return
        if unit.host_current:
            # Unchanged since it came back (a frozen parameter's shard, state of a parameter the
            # step skipped): the host already has these bytes; only the device copy goes. It may
            # be freed once the compute stream is past its reload.
            self.lanes.wait(unit.reloading)
            unit.reloading = None
        else:
            unit.written = self.lanes.offload(unit.host, unit.device_bytes)
            unit.host_current = True
        self._hand_gathers(unit, to_host=True)
        unit.device_bytes.untyped_storage().resize_(0)
        unit.on_host = True

    def _hand_gathers(self, unit: OffloadUnit, to_host: bool) -> None:
        """Parameter offload: a master unit (under ZeRO-3 one parameter's shard storage) is what
        the runtime gathers from; point its gathers at the host copy while it is there, back at
        the device shard once the reload is waited for (the runtime orders host reads after the
        offload lane's copies)."""
        if not (self.settings.offload_masters and unit.what == MASTER):
            return
        from deepcompile import runtime

        if not to_host and not runtime.is_initialized():
            return  # the runtime is gone (engine teardown): no gather to point back
        for ds_id in unit.ds_ids:
            host = None
            if to_host:
                shard = runtime.registered_shard(ds_id)
                start = shard.storage_offset()
                host = unit.host.view(shard.dtype)[start: start + shard.numel()]
            runtime.set_host_shard(ds_id, host)

    def _reload(self, unit: OffloadUnit) -> None:
        if not unit.on_host:
            return
        # Allocated on the compute stream, where the step will use it.
        unit.device_bytes.untyped_storage().resize_(unit.nbytes)
        unit.reloading = self.lanes.reload(unit.device_bytes, unit.host, unit.written)
        unit.on_host = False

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
        self.lanes.synchronize()
        self.releases.drain()
        if self.sharding.state_access is self:
            self.sharding.state_access = None
        for unit in self.units.values():
            unit.host = None
        self.units = {}
