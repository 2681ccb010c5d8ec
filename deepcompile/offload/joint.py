"""The memory planner: the one owner of the offload plan and of *when* it is (re)made.

Every kind of device memory the plan weighs is a side behind one protocol (``sides.py``:
``OffloadSide``: what it measured, what it could free and at what cost, how it takes its share):
optimizer state and master shards (``opt_state_plan.py``: ``UnitSide``), activations
(``ActivationSide``) and the pass schedule's prefetch and persistence (``ScheduleSide``, which
frees nothing and moves the floor). The kinds report what happened (the step created state,
a window closed, the schedule switched); :class:`MemoryPlanner` decides from that whether a plan
is made and hands each side its share. With optimizer-state or parameter offload on, the plan is
the joint one (``joint_plan.py``); activation offload alone is planned by its bytes alone
(``plan.py``), at the same point.

Before any measurement each side runs provisionally, so a job that fits only with offloading runs
from its first step: every activation candidate is offloaded, the master shards of parameter
offload go to the host at initialize, optimizer state created by a streamed step is written back
at once. Then the joint plan is made, and redone, at these points (every rank alike: the
measurements are all-reduced, the largest memory readings and the slowest link win):

1. after an optimizer step that created optimizer state (the first one; ``StateChange.created``,
   :meth:`MemoryPlanner.after_state_change`): the units are planned alone first (``plan.py``, with
   the floors agreed), then jointly; its decisions for optimizer state and master shards apply
   from then on; activations stay all offloaded, so the next window measures their floor. State
   replaced on one rank outside a step (checkpoint loading) is planned alone, without a collective;
2. before the second optimizer step (:meth:`MemoryPlanner.at_activation_window`): the activation floor of
   two windows is known; the plan is redone and applies to all three kinds;
3. after a schedule switch (:meth:`MemoryPlanner.at_schedule_switch`, from ``ScheduleSide``:
   prefetch and persistence change what the forward and backward hold), once the switch's first
   micro-step has measured the new graphs: if the measured peak moved (the largest graph peak,
   after the switch against the profile it was planned from, each without the offloadable bytes
   resident then), or the profile brought the first measured op times, the plan is redone, and the report's history says so. On CUDA the floor moves with the
   peak; on a CPU device (floors read 0, ``device_memory.py``) it does not.

The floors: ``fb_floor`` is the larger of the optimizer-state side's forward/backward peak without
its units and the activation side's floor (sampled at every offload/reload/wait with the resident
units left out, ``ActivationOffloader.resident_elsewhere``); ``step_floor`` is the optimizer-state
side's (``plan.py``). The compute that copies hide behind: per phase, the ZeRO-3 profile's op
times (one micro-step, times the accumulation steps) once the schedule has profiled, else the
engine's timings under ``wall_clock_breakdown``, else none (every copy counts as exposed, and the
plan minimises transfer time). Each activation run has its position in the forward
(``ActivationOffloader.positions``), by which the plan places its copies in their phases. The
step's time comes from ``wall_clock_breakdown`` only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist

from deepcompile.memory.budget import MemoryBudget
from deepcompile.offload import bandwidth, device_memory, host_memory
from deepcompile.offload.joint_plan import KINDS, ComputeTimes, JointPlan, Link, plan_jointly
from deepcompile.offload.plan import OffloadBudgetError, plan_offload
from deepcompile.offload.ranks import max_over_ranks
from deepcompile.offload.sides import ActivationSide, OffloadSide, ScheduleSide, Share


class MeasuredCompute(NamedTuple):
    """Compute seconds per optimizer step that copies can hide behind, and where they come from
    ("profile" or "wall_clock_breakdown")."""

    forward_s: float
    backward_s: float
    step_s: float
    source: str


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """The measurements a joint plan was made from, agreed over the ranks."""

    fb_floor_bytes: int
    step_floor_bytes: int
    compute: ComputeTimes
    compute_source: str
    link: Link


class MemoryPlanner:
    """``units``: optimizer-state offload's side (``UnitSide``), or None; ``activations``: the
    ``ActivationMemory`` with offload on, or None; ``schedule``: the pass schedule's side;
    ``budget``: the engine's (``memory/budget.py``); ``compute``: the compute per optimizer step
    (None when nothing is measured)."""

    def __init__(self, units: Optional[Any], activations: Optional[Any], schedule: Optional[ScheduleSide],
                 budget: MemoryBudget, micro_steps: int, compute: Callable[[], Optional[MeasuredCompute]],
                 device: torch.device, group: Optional[dist.ProcessGroup]):
        self.units = units
        self.activations = ActivationSide(activations) if activations is not None else None
        self.schedule = schedule
        self.budget = budget
        self.micro_steps = micro_steps
        self.compute = compute
        self.device = device
        self.group = group
        self.plan: Optional[JointPlan] = None
        self.inputs: Optional[PlanInputs] = None
        self.history: List[Dict[str, Any]] = []
        self._peak_at_plan = 0
        self._resident_at: Dict[str, int] = {}
        # The kinds the plan weighs, in the order their decisions are applied.
        self.sides: List[OffloadSide] = [s for s in (self.activations, units, schedule) if s is not None]

    @property
    def joint(self) -> bool:
        """The plan weighs optimizer state and master shards (and activations, when on) together."""
        return self.units is not None

    def _max_over_ranks(self, values: List[float]) -> List[int]:
        return max_over_ranks(values, self.device, self.group)

    def _activations_planned(self) -> bool:
        """The activation side's provisional window (everything offloaded) is over."""
        return self.activations is not None and self.activations.window_closed

    # ---- when to plan: what the kinds report ---------------------------------------------------

    def after_state_change(self, change: Any) -> None:
        """After an optimizer step (``opt_state_plan.StateChange``): state it created is planned on
        every rank together, alone first (the floors agreed) and then jointly; state replaced on
        this rank alone (checkpoint loading) is planned alone, without a collective."""
        units = self.units
        if change.created:
            units.plan_units(change.found, agree=True)
            failure = self.replan(f"optimizer state planned after step {units.steps}", vote=False)
            failure = failure or units.take_failure()
            (failed,) = self._max_over_ranks([float(failure is not None)])
            if failed:
                raise units.host_buffer_error(failure)
        elif change.replaced:
            units.plan_units(change.found, agree=False)
            failure = units.ensure_host_buffers()
            if failure is not None:
                raise units.host_buffer_error(failure)

    def at_activation_window(self, global_steps: int) -> None:
        """Before optimizer step ``global_steps``, where the activations act: at the second step
        the activation floor of two windows is known and the activations are planned (jointly
        when optimizer state is planned too; their floor left its resident units out)."""
        side = self.activations
        if side is None or side.window_closed or global_steps < 1:
            return
        side.activations.close_window(global_steps)
        if self.joint:
            self.replan("activation floor of two windows measured")
            return
        if self.budget.bytes is None:
            return  # no budget: everything stays offloaded
        cands = side.candidates()
        alone = plan_offload([c.nbytes for c in cands], self.budget.bytes - side.activations.floor_bytes, 0.0)
        side.apply(Share({c.key: out for c, out in zip(cands, alone.offloaded)}, None))

    def note_micro_step(self, mode: Optional[str]) -> None:
        """Before a forward the schedule profiles (``mode`` "plan": the profile a switch plans
        from; "verify": the switch's first micro-step): the offloadable bytes on the device then,
        so that a moved peak is compared without them."""
        if mode is not None:
            self._resident_at[mode] = sum(side.resident_bytes() for side in self.sides)

    def at_schedule_switch(self) -> None:
        """Before an optimizer step: once a schedule switch's first micro-step has been measured,
        redo the plan if the measured peak moved or op times were measured for the first time."""
        if self.schedule is None or self.plan is None:
            return
        news = self.schedule.switch_news(self._resident_at)
        if news is None:
            return
        reasons = []
        if news.moved:
            reasons.append(f"measured peak moved by {news.moved} bytes "
                           f"({news.profiled_peak_bytes} -> {news.measured_peak_bytes})")
        compute = self.compute()
        if compute is not None and compute.source != self.inputs.compute_source:
            reasons.append(f"compute times now from the {compute.source}")
        (redo,) = self._max_over_ranks([float(bool(reasons))])
        if redo:
            self.replan(f"schedule switch at step {news.step}: " + ("; ".join(reasons) or "on another rank"))

    # ---- measurements -------------------------------------------------------------------------

    def _link(self) -> Link:
        link = bandwidth.copy_bandwidth(self.device)
        if link is not None:
            return Link(link.host_to_device, link.device_to_host)
        rate = bandwidth.host_to_device_bytes_per_s(self.device)  # a CPU device: memcpy
        return Link(rate, rate)

    def _measure(self) -> PlanInputs:
        compute = self.compute()
        link = self._link()
        floors = [side.floors() for side in self.sides]
        floor = max(f.forward_backward for f in floors) + sum(f.shift for f in floors)
        step_floor = max(f.step for f in floors)
        f, b, s, source = compute if compute is not None else (0.0, 0.0, 0.0, "none")
        # One decision for all ranks: the largest readings, the slowest link (integers: bytes,
        # microseconds, bytes per second negated).
        floor, step_floor, f_us, b_us, s_us, h2d, d2h = self._max_over_ranks(
            [floor, step_floor, f * 1e6, b * 1e6, s * 1e6, -link.host_to_device, -link.device_to_host])
        return PlanInputs(floor, step_floor, ComputeTimes(f_us / 1e6, b_us / 1e6, s_us / 1e6), source,
                          Link(max(-h2d, 1), max(-d2h, 1)))

    # ---- planning -----------------------------------------------------------------------------

    def replan(self, reason: str, vote: bool = True) -> Optional[str]:
        """Plan all kinds together and hand each side its share (activations only once their
        provisional window is over). ``vote``: raise a host-buffer failure on every rank here;
        otherwise it is returned for the caller's vote."""
        m = self._measure()
        cands = [c for side in self.sides for c in side.candidates()]
        error = None
        try:
            plan = plan_jointly(cands, self.budget.bytes, m.fb_floor_bytes, m.step_floor_bytes, self.units.streams,
                                m.link, m.compute, self.micro_steps, self.units.min_state_fraction,
                                self.budget.source)
        except OffloadBudgetError as e:
            error = e
        # The floors are the same on every rank, the candidates not quite (shard sizes): a budget
        # that one rank cannot meet is raised on every rank.
        (failed,) = self._max_over_ranks([float(error is not None)])
        if failed:
            raise error or OffloadBudgetError("offload: the memory budget cannot be met on another rank (its error "
                                              "names the minimum there)")
        self.plan, self.inputs = plan, m
        share = Share({c.key: out for c, out in zip(cands, plan.offloaded)}, plan.headroom)
        failure = None
        for side in self.sides:
            failure = side.apply(share) or failure
        self._peak_at_plan = device_memory.peak_allocated(self.device)
        self.history.append({"after_step": self.units.steps, "reason": reason,
                             "activations_applied": self._activations_planned(),
                             "offloaded_bytes": dict(plan.offloaded_bytes),
                             "predicted_exposed_ms_per_step": plan.exposed_total_s * 1e3})
        if not vote:
            return failure
        (failed,) = self._max_over_ranks([float(failure is not None)])
        if failed:
            raise host_memory.PinnedMemoryError(
                "offload (joint plan) could not allocate its host buffers"
                + (f" on this rank ({failure})" if failure else " on another rank")
                + "; raise compile.memory_budget_*, free host memory, or turn pin_memory off")
        return None

    # ---- report -------------------------------------------------------------------------------

    def report(self) -> Dict[str, Any]:
        plan, m = self.plan, self.inputs
        if plan is None:
            return {"planned": False, "note": "planned after the first optimizer step; until then every "
                    "activation candidate is offloaded (and parameter offload's masters)"}
        peak_now = device_memory.peak_allocated(self.device)
        return {
            "planned": True,
            "budget_bytes": self.budget.bytes,
            "budget": self.budget.source,
            "fb_floor_bytes": m.fb_floor_bytes,
            "step_floor_bytes": m.step_floor_bytes,
            "link": {"host_to_device": m.link.host_to_device, "device_to_host": m.link.device_to_host},
            "compute_s": {"forward": m.compute.forward_s, "backward": m.compute.backward_s, "step": m.compute.step_s},
            "compute_source": m.compute_source,
            "kinds": {k: {"offloaded_bytes": plan.offloaded_bytes[k], "resident_bytes": plan.resident_bytes[k],
                          "predicted_transfer_ms_per_step": plan.transfer_s[k] * 1e3,
                          "predicted_exposed_ms_per_step": plan.exposed_s[k] * 1e3} for k in KINDS},
            "predicted_transfer_ms_per_step": sum(plan.transfer_s.values()) * 1e3,
            "predicted_exposed_ms_per_step": plan.exposed_total_s * 1e3,
            "predicted_peak_bytes": plan.predicted_peak,
            "predicted_forward_backward_peak_bytes": plan.predicted_fb_peak,
            "predicted_step_peak_bytes": plan.predicted_step_peak,
            # As optimizer-state offload's report: the allocator's peak is never reset, so only a
            # peak above the one at the plan is known to come from after it.
            "measured_peak_bytes": peak_now if peak_now > self._peak_at_plan else None,
            "peak_at_plan_bytes": self._peak_at_plan,
            "history": list(self.history),
        }


def measured_compute(driver: Any, step_report: Any, micro_steps: int) -> Optional[MeasuredCompute]:
    """Compute seconds per optimizer step (forward, backward, step) and where they come from: the
    schedule's last profile (one micro-step's op times, ``ScheduleDriver.compute_profiles``), else
    ``wall_clock_breakdown``'s timings since its last line (``StepReport.phase_seconds``); None
    when neither exists."""
    profiles = driver.compute_profiles()
    timed = step_report.phase_seconds()
    if profiles:
        f = sum(p.total_time_ms for p in profiles if p.phase == "forward") / 1e3 * micro_steps
        b = sum(p.total_time_ms for p in profiles if p.phase == "backward") / 1e3 * micro_steps
        return MeasuredCompute(f, b, timed.step if timed is not None else 0.0, "profile")
    if timed is not None:
        return MeasuredCompute(timed.forward, timed.backward, timed.step, "wall_clock_breakdown")
    return None


def memory_planner(units: Optional[Any], activations: Optional[Any], schedule: Optional[ScheduleSide],
                   budget: MemoryBudget, micro_steps: int, compute: Callable[[], Optional[MeasuredCompute]],
                   device: torch.device, group: Optional[dist.ProcessGroup]) -> Optional[MemoryPlanner]:
    """The planner whenever a kind it plans is on: optimizer-state or parameter offload
    (``units``), activation offload (``activations``, taken in when its offload is on)."""
    activations = activations if activations is not None and activations.offload else None
    if units is None and activations is None:
        return None
    return MemoryPlanner(units, activations, schedule, budget, micro_steps, compute, device, group)
