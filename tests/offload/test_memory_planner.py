"""The memory planner (deepcompile/offload/joint.py) owns when the offload plan is made: the kinds
report what happened (typed: ``StateChange``, ``SwitchPeaks``) and it decides. These check the
decisions that need no process group; the collective ones run in tests/offload/test_joint_offload.py."""

from __future__ import annotations

import torch

from deepcompile.memory.budget import MemoryBudget
from deepcompile.offload.joint import MemoryPlanner
from deepcompile.offload.opt_state_plan import StateChange
from deepcompile.offload.sides import Floors, ScheduleSide
from deepcompile.scheduling.driver import SwitchPeaks


class _Units:
    """Stands in for optimizer-state offload's side; records what the planner asks of it."""

    streams, steps, min_state_fraction = False, 1, 0.0

    def __init__(self):
        self.calls = []

    def plan_units(self, found, agree):
        self.calls.append(("plan_units", agree))

    def ensure_host_buffers(self):
        self.calls.append(("ensure_host_buffers",))
        return None

    def floors(self):
        return Floors(0, 0)


def _planner(units, schedule=None):
    return MemoryPlanner(units, None, schedule, MemoryBudget(None, "none"), 1, lambda: None,
                         torch.device("cpu"), None)


def test_state_replaced_on_one_rank_is_planned_alone_and_nothing_else_replans():
    units = _Units()
    planner = _planner(units)
    planner.after_state_change(StateChange({}, created=False, replaced=False))
    assert units.calls == [] and planner.plan is None  # the step changed nothing: no plan
    planner.after_state_change(StateChange({}, created=False, replaced=True))
    # A checkpoint load on this rank: its units alone, no collective (agree=False), no joint plan.
    assert units.calls == [("plan_units", False), ("ensure_host_buffers",)] and planner.history == []


class _Driver:
    def __init__(self):
        self.switch = None

    def last_switch(self):
        return self.switch


def test_the_schedule_side_reports_a_switch_once_and_moves_the_floor_on_a_gpu_only():
    resident = {"plan": 100, "verify": 50}  # offloadable bytes on the device at each profile
    for cuda, shift in ((True, 250), (False, 0)):
        driver = _Driver()
        side = ScheduleSide(driver, cuda)
        assert side.switch_news(resident) is None and side.candidates() == []  # no switch yet; frees nothing
        driver.switch = SwitchPeaks(3, 700, 900)
        news = side.switch_news(resident)
        # Each peak without the offloadable bytes resident when it was measured: 850 - 600.
        assert (news.step, news.moved) == (3, 250)
        assert side.floors() == Floors(shift=shift)
        assert side.switch_news(resident) is None  # the same switch is news once
    driver.switch = SwitchPeaks(5, 700, None)  # compile.verify_plan off: the peak is not measured
    assert side.switch_news(resident).moved == 0


def test_no_schedule_switch_is_read_before_the_first_plan():
    driver = _Driver()
    driver.switch = SwitchPeaks(3, 700, 900)
    side = ScheduleSide(driver, True)
    planner = _planner(_Units(), side)
    planner.at_schedule_switch()  # no plan yet: the switch stays unread for the first plan to see
    assert side.switch_news({}) is not None
