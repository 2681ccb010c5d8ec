"""The one protocol every kind of device memory the planner weighs is behind (``OffloadSide``),
the typed values it speaks in, and the sides that adapt a kind whose implementation lives
elsewhere: activations (``activations.py``) and the pass schedule's prefetch and persistence
(``scheduling/``). Optimizer state and master shards are ``opt_state_plan.py``'s ``UnitSide``.

The planner (``joint.py``: ``MemoryPlanner``) asks each side what it measured (``floors``), what
it could free and what that costs (``candidates``: bytes, kind and, for activations, where in the
forward the tensor is computed; the kind decides the copy cost in ``joint_plan.py``), and hands
each its share of the decision (``apply``). A side never plans, and never decides when a plan is
made: the planner does, from the measurements.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Protocol

from deepcompile.offload.joint_plan import ACTIVATION, Candidate


@dataclasses.dataclass(frozen=True)
class Floors:
    """What a side measured of the device memory the plan cannot move.

    ``forward_backward``: the forward/backward peak with this side's candidates off the device;
    ``step``: the optimizer step's peak likewise (``plan.py``); ``shift``: how far this side moved
    the forward/backward peak since it was measured (the planner adds it to the largest floor)."""

    forward_backward: int = 0
    step: int = 0
    shift: int = 0


@dataclasses.dataclass(frozen=True)
class Share:
    """A side's part of a plan: ``decided`` maps the keys of the candidates it last offered to
    whether they are offloaded; ``headroom``: the bytes the budget leaves above the plan's peak
    (None: no budget)."""

    decided: Dict[Any, bool]
    headroom: Optional[int]


class OffloadSide(Protocol):
    """One kind of device memory the planner weighs. Keys of candidates are the side's own and
    distinct from every other side's."""

    name: str

    def floors(self) -> Floors:
        """What this side measured (see :class:`Floors`)."""
        ...

    def resident_bytes(self) -> int:
        """Bytes of this side's candidates on the device now (left out of a measured peak)."""
        ...

    def candidates(self) -> List[Candidate]:
        """What this side could free now, each with its bytes and kind (what its copies cost)."""
        ...

    def apply(self, share: Share) -> Optional[str]:
        """Take the plan's decisions on the candidates last offered. Returns why a host buffer
        could not be allocated on this rank (None: all were), for the planner's vote."""
        ...


class ActivationSide:
    """Activation offload's runs (``activations.py``, ``activation_ops.py``): its decisions apply
    once its provisional window (every candidate offloaded, to measure the floor) is over."""

    name = ACTIVATION

    def __init__(self, activations: Any):
        self.activations = activations
        self._runs: List[Any] = []

    @property
    def window_closed(self) -> bool:
        return self.activations.planned_after_step is not None

    def floors(self) -> Floors:
        return Floors(forward_backward=self.activations.offloader.observed_peak)

    def resident_bytes(self) -> int:
        o = self.activations.offloader
        if o.plan is None:
            return 0
        return sum(s.bytes_per_micro_step - s.nbytes * o.planned_runs(s) for s in o.stats.values() if s.offloads)

    def candidates(self) -> List[Candidate]:
        o = self.activations.offloader
        self._runs = o.planning_runs()
        return [Candidate(("act", s.key, run), ACTIVATION, s.nbytes, position=o.positions.get((s.key, run), 0.0))
                for s, run in self._runs]

    def apply(self, share: Share) -> Optional[str]:
        if self.window_closed:
            self.activations.offloader.plan = {(s.key, run) for s, run in self._runs
                                               if share.decided[("act", s.key, run)]}
        return None


@dataclasses.dataclass(frozen=True)
class SwitchNews:
    """What a schedule switch changed, as the schedule side read it: ``moved``: how far the
    measured peak moved (0: not at all, or not measured)."""

    step: int
    moved: int
    profiled_peak_bytes: int
    measured_peak_bytes: Optional[int]


class ScheduleSide:
    """The pass schedule's prefetch and persistent parameters (``scheduling/planner.py``, run by
    the schedule driver at its switches). They hold device memory for speed and free none that the
    offload plan could move, so they offer no candidates; their share is the whole budget, which
    the driver plans against from profiles that already hold what the offload plan keeps
    resident. What they tell the planner is how a switch moved the forward/backward peak
    (``floors().shift``), so the plan is redone on the moved floor.

    ``driver``: the schedule driver (its typed ``last_switch()``, ``SwitchPeaks``); ``cuda``: the
    device is a GPU (profiled peaks are allocated device bytes only there)."""

    name = "schedule"

    def __init__(self, driver: Any, cuda: bool):
        self.driver = driver
        self.cuda = cuda
        self._shift = 0
        self._seen: Optional[int] = None

    def floors(self) -> Floors:
        return Floors(shift=self._shift)

    def resident_bytes(self) -> int:
        return 0

    def candidates(self) -> List[Candidate]:
        return []

    def apply(self, share: Share) -> Optional[str]:
        return None

    def switch_news(self, resident_at: Dict[str, int]) -> Optional[SwitchNews]:
        """The last switch, once, when its peaks are final (None: no new switch). ``resident_at``:
        the offloadable bytes on the device when the profile it was planned from ("plan") and its
        first micro-step ("verify") were measured, left out of both peaks."""
        switch = self.driver.last_switch()  # scheduling/driver.py: SwitchPeaks
        if switch is None or switch.step == self._seen:
            return None
        self._seen = switch.step
        before, after = switch.profiled_peak_bytes, switch.measured_peak_bytes
        # Without a verify profile (compile.verify_plan off, the default) the switched schedule's
        # peak is not measured: no move can be read.
        # Left out: what the plans kept on the device at each measurement (they may differ).
        moved = 0 if after is None else (after - resident_at.get("verify", 0)) - (before - resident_at.get("plan", 0))
        if moved and self.cuda:
            # Profiled peaks are allocated device bytes: prefetch and persistence move the floor.
            # (On a CPU device the profiler measures a graph's working set while the floors read
            # 0, device_memory.py: the plan is redone, the floor stays.)
            self._shift += moved
        return SwitchNews(switch.step, moved, before, after)
