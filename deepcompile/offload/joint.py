"""The engine's side of the joint offload plan (``joint_plan.py``): one decision for activation
offload, optimizer-state offload and parameter offload, whenever optimizer-state or parameter
offload is on (with activation offload or without: the plan then weighs optimizer state and master
shards alone, from the same measurements). Activation offload alone keeps its own plan
(``activations.py``). Each kind is behind one protocol, ``OffloadSide`` (the candidates it offers,
how it takes the decisions): ``ActivationSide`` and ``UnitSide``.

Before any measurement each side runs provisionally, so a job that fits only with offloading runs
from its first step: every activation candidate is offloaded, the master shards of parameter
offload go to the host at initialize, optimizer state created by a streamed step is written back
at once. Then the joint plan is made, and redone, at these points (every rank alike: the
measurements are all-reduced, the largest memory readings and the slowest link win):

1. after the first optimizer step, when optimizer state exists (``OptimizerStateOffload._replan``
   calls :meth:`JointOffload.replan`): its decisions for optimizer state and master shards apply
   from then on; activations stay all offloaded, so the next window measures their floor;
2. before the second optimizer step (``ActivationMemory.before_step``): the activation floor of
   two windows is known; the plan is redone and applies to all three kinds;
3. after a schedule switch (``scheduling/``: prefetch and persistence change what the forward and
   backward hold), once the switch's first micro-step has measured the new graphs: if the measured
   peak moved (the largest graph peak, after the switch against the profile it was planned from,
   each without the offloadable bytes resident then), or the profile brought the first measured op
   times, the plan is redone, and the report's history says so. On CUDA the floor moves with the
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

from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

from deepcompile.offload import bandwidth, device_memory, host_memory
from deepcompile.offload.joint_plan import (ACTIVATION, KINDS, MASTER, OPTIMIZER_STATE, Candidate, ComputeTimes,
                                            JointPlan, Link, plan_jointly)
from deepcompile.offload.plan import OffloadBudgetError


class OffloadSide(Protocol):
    """One kind of offloadable memory the joint plan weighs (activations; optimizer state and
    master shards): the candidates it offers now, and how it takes the plan's decisions on them.
    Keys are the side's own and distinct from every other side's."""

    def candidates(self) -> List[Candidate]:
        ...

    def apply(self, decided: Dict[Any, bool], headroom: Optional[int]) -> Optional[str]:
        """Take the plan's decisions (candidate key -> offloaded) on the candidates last offered;
        ``headroom``: the bytes the budget leaves above the plan's peak (None: no budget). Returns
        why a host buffer could not be allocated on this rank (None: all were), for the vote."""
        ...


class ActivationSide:
    """Activation offload's runs (``activations.py``): applied once its provisional window (every
    candidate offloaded, to measure the floor) is over."""

    def __init__(self, activations: Any):
        self.activations = activations
        self._runs: List[Any] = []

    def candidates(self) -> List[Candidate]:
        o = self.activations.offloader
        self._runs = o.planning_runs()
        return [Candidate(("act", s.key, run), ACTIVATION, s.nbytes, position=o.positions.get((s.key, run), 0.0))
                for s, run in self._runs]

    def apply(self, decided: Dict[Any, bool], headroom: Optional[int]) -> Optional[str]:
        if self.activations.planned_after_step is not None:
            self.activations.offloader.plan = {(s.key, run) for s, run in self._runs if decided[("act", s.key, run)]}
        return None


class UnitSide:
    """Optimizer-state offload's units (``opt_states.py``): optimizer state, and with parameter
    offload the ZeRO-3 master shards."""

    def __init__(self, offload: Any):
        self.offload = offload
        self._units: List[Any] = []

    def candidates(self) -> List[Candidate]:
        off, settings = self.offload, self.offload.settings
        self._units = off.joint_units()
        cands = []
        for u in self._units:
            master = off.is_master_shard(u)
            cands.append(Candidate(("unit", u.storage_key), MASTER if master else OPTIMIZER_STATE, u.nbytes,
                                   forced=master and settings.force_masters,
                                   eligible=settings.offload_masters if master else settings.offload_state))
        return cands

    def apply(self, decided: Dict[Any, bool], headroom: Optional[int]) -> Optional[str]:
        return self.offload.apply_joint_plan({u.storage_key: decided[("unit", u.storage_key)] for u in self._units},
                                             headroom)


class JointOffload:
    """``offload``: the engine's ``OptimizerStateOffload``; ``activations``: its
    ``ActivationMemory`` with offload on, or None; ``compute``: returns (forward_s, backward_s,
    step_s, source) per optimizer step, or None when nothing is measured."""

    def __init__(self, offload: Any, activations: Optional[Any], micro_steps: int,
                 compute: Callable[[], Optional[Tuple[float, float, float, str]]]):
        self.offload = offload
        self.activations = activations
        self.micro_steps = micro_steps
        self.compute = compute
        self.plan: Optional[JointPlan] = None
        self.inputs: Dict[str, Any] = {}
        self.history: List[Dict[str, Any]] = []
        self._peak_at_plan = 0
        self._switch_seen: Optional[int] = None
        self._floor_shift = 0  # the measured peak's move at schedule switches (CUDA)
        self._resident_at: Dict[str, int] = {}
        # The kinds the plan weighs, in the order their decisions are applied.
        self.sides: List[OffloadSide] = ([ActivationSide(activations)] if activations is not None else []) \
            + [UnitSide(offload)]
        offload.joint = self
        if activations is not None:
            activations.joint = self
            activations.offloader.resident_elsewhere = offload.resident_offloadable_bytes

    @property
    def _offloader(self) -> Optional[Any]:
        """The activation side's run-time state (None: activation offload is off)."""
        return self.activations.offloader if self.activations is not None else None

    def _activations_planned(self) -> bool:
        """The activation side's provisional window (everything offloaded) is over."""
        return self.activations is not None and self.activations.planned_after_step is not None

    # ---- measurements -------------------------------------------------------------------------

    def _link(self) -> Link:
        link = bandwidth.copy_bandwidth(self.offload.device)
        if link is not None:
            return Link(link.host_to_device, link.device_to_host)
        rate = bandwidth.host_to_device_bytes_per_s(self.offload.device)  # a CPU device: memcpy
        return Link(rate, rate)

    def _measure(self) -> Dict[str, Any]:
        off, o = self.offload, self._offloader
        compute = self.compute()
        link = self._link()
        floor = max(off.peak_without or 0, o.observed_peak if o is not None else 0) + self._floor_shift
        step_floor = off.step_floor or 0
        f, b, s, source = compute if compute is not None else (0.0, 0.0, 0.0, "none")
        # One decision for all ranks: the largest readings, the slowest link (integers: bytes,
        # microseconds, bytes per second negated).
        floor, step_floor, f_us, b_us, s_us, h2d, d2h = off.max_over_ranks(
            [floor, step_floor, f * 1e6, b * 1e6, s * 1e6, -link.host_to_device, -link.device_to_host])
        return {"fb_floor_bytes": floor, "step_floor_bytes": step_floor,
                "compute": ComputeTimes(f_us / 1e6, b_us / 1e6, s_us / 1e6), "compute_source": source,
                "link": Link(max(-h2d, 1), max(-d2h, 1))}

    # ---- planning -----------------------------------------------------------------------------

    def replan(self, reason: str, vote: bool = True) -> Optional[str]:
        """Plan all three kinds together and apply it (activations only once their provisional
        window is over). ``vote``: raise a host-buffer failure on every rank here; otherwise it is
        returned for the caller's vote."""
        off = self.offload
        m = self._measure()
        settings = off.settings
        cands = [c for side in self.sides for c in side.candidates()]
        error = None
        try:
            plan = plan_jointly(cands, settings.budget_bytes, m["fb_floor_bytes"], m["step_floor_bytes"], off.streams,
                                m["link"], m["compute"], self.micro_steps, settings.min_fraction, settings.budget_name)
        except OffloadBudgetError as e:
            error = e
        # The floors are the same on every rank, the candidates not quite (shard sizes): a budget
        # that one rank cannot meet is raised on every rank.
        (failed,) = off.max_over_ranks([float(error is not None)])
        if failed:
            raise error or OffloadBudgetError("offload: the memory budget cannot be met on another rank (its error "
                                              "names the minimum there)")
        self.plan, self.inputs = plan, m
        decided = {c.key: out for c, out in zip(cands, plan.offloaded)}
        failure = None
        for side in self.sides:
            failure = side.apply(decided, plan.headroom) or failure
        self._peak_at_plan = device_memory.peak_allocated(off.device)
        self.history.append({"after_step": off.steps, "reason": reason,
                             "activations_applied": self._activations_planned(),
                             "offloaded_bytes": dict(plan.offloaded_bytes),
                             "predicted_exposed_ms_per_step": plan.exposed_total_s * 1e3})
        if not vote:
            return failure
        (failed,) = off.max_over_ranks([float(failure is not None)])
        if failed:
            raise host_memory.PinnedMemoryError(
                "offload (joint plan) could not allocate its host buffers"
                + (f" on this rank ({failure})" if failure else " on another rank")
                + "; raise compile.memory_budget_*, free host memory, or turn pin_memory off")
        return None

    def note_micro_step(self, mode: Optional[str]) -> None:
        """Before a forward the schedule profiles (``mode`` "plan": the profile a switch plans
        from; "verify": the switch's first micro-step): the offloadable bytes on the device then,
        so that a moved peak is compared without them."""
        if mode is not None:
            self._resident_at[mode] = self._resident_now()

    def _resident_now(self) -> int:
        o = self._offloader
        kept = 0 if o is None or o.plan is None else sum(s.bytes_per_micro_step - s.nbytes * o.planned_runs(s)
                                               for s in o.stats.values() if s.offloads)
        return kept + self.offload.resident_offloadable_bytes()

    def at_schedule_switch(self, driver: Any) -> None:
        """Before an optimizer step: once a schedule switch's first micro-step has been measured,
        redo the plan if the measured peak moved or op times were measured for the first time."""
        switch = driver.last_switch()  # scheduling/driver.py: SwitchPeaks
        if switch is None or self.plan is None or switch.step == self._switch_seen:
            return
        self._switch_seen = switch.step
        before, after = switch.profiled_peak_bytes, switch.measured_peak_bytes
        # Without a verify profile (compile.verify_plan off, the default) the switched schedule's
        # peak is not measured: no move can be read.
        # Left out: what the plans kept on the device at each measurement (they may differ).
        moved = 0 if after is None else \
            (after - self._resident_at.get("verify", 0)) - (before - self._resident_at.get("plan", 0))
        reasons = []
        if moved:
            if self.offload.device.type == "cuda":
                # Profiled peaks are allocated device bytes: prefetch and persistence move the floor.
                self._floor_shift += moved
            # (On a CPU device the profiler measures a graph's working set while the floors read 0,
            # device_memory.py: the plan is redone, the floor stays.)
            reasons.append(f"measured peak moved by {moved} bytes ({before} -> {after})")
        source = self.compute()
        if source is not None and source[3] != self.inputs.get("compute_source"):
            reasons.append(f"compute times now from the {source[3]}")
        (redo,) = self.offload.max_over_ranks([float(bool(reasons))])
        if redo:
            self.replan(f"schedule switch at step {switch.step}: " + ("; ".join(reasons) or "on another rank"))

    # ---- report -------------------------------------------------------------------------------

    def report(self) -> Dict[str, Any]:
        plan, m = self.plan, self.inputs
        if plan is None:
            return {"planned": False, "note": "planned after the first optimizer step; until then every "
                    "activation candidate is offloaded (and parameter offload's masters)"}
        peak_now = device_memory.peak_allocated(self.offload.device)
        link = m["link"]
        return {
            "planned": True,
            "budget_bytes": self.offload.settings.budget_bytes,
            "budget": self.offload.settings.budget_name,
            "fb_floor_bytes": m["fb_floor_bytes"],
            "step_floor_bytes": m["step_floor_bytes"],
            "link": {"host_to_device": link.host_to_device, "device_to_host": link.device_to_host},
            "compute_s": {"forward": m["compute"].forward_s, "backward": m["compute"].backward_s,
                          "step": m["compute"].step_s},
            "compute_source": m["compute_source"],
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


def measured_compute(driver: Any, step_report: Any, micro_steps: int) -> Optional[Tuple[float, float, float, str]]:
    """Compute seconds per optimizer step (forward, backward, step) and where they come from: the
    schedule's last profile (one micro-step's op times, ``ScheduleDriver.compute_profiles``), else
    ``wall_clock_breakdown``'s timings since its last line (``StepReport.phase_seconds``); None
    when neither exists."""
    profiles = driver.compute_profiles()
    timed = step_report.phase_seconds()
    if profiles:
        f = sum(p.total_time_ms for p in profiles if p.phase == "forward") / 1e3 * micro_steps
        b = sum(p.total_time_ms for p in profiles if p.phase == "backward") / 1e3 * micro_steps
        return f, b, timed.step if timed is not None else 0.0, "profile"
    if timed is not None:
        return timed.forward, timed.backward, timed.step, "wall_clock_breakdown"
    return None


def joint_offload(offload: Any, activations: Any, micro_steps: int,
                  compute: Callable[[], Optional[Tuple[float, float, float, str]]]) -> Optional[JointOffload]:
    """The joint plan whenever optimizer-state or parameter offload is on (``activations``: the
    activation side, taken in when its offload is on)."""
    if offload is None:
        return None
    return JointOffload(offload, activations if activations is not None and activations.offload else None,
                        micro_steps, compute)
