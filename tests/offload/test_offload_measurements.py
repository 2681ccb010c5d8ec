"""What the offload plan reads of the schedule and the step report is typed
(``ScheduleDriver.last_switch``/``compute_profiles``, ``StepReport.phase_seconds``), and
``offload/joint.py: measured_compute`` turns it into compute times per optimizer step."""

from __future__ import annotations

import torch

from deepcompile.config import Config
from deepcompile.memory.budget import MemoryBudget
from deepcompile.offload.joint import measured_compute
from deepcompile.profiling.graph_profiler import GraphProfile, NodeProfile
from deepcompile.scheduling.driver import ScheduleDriver, SwitchPeaks
from deepcompile.scheduling.schedule import PLAIN, PassSchedule
from deepcompile.step_report import PhaseSeconds, StepReport


def _driver():
    config = Config.from_any({"zero_optimization": {"stage": 3}})
    return ScheduleDriver(config.compile, PassSchedule.from_config(config), prefetch_bucket_numel=1 << 20, stage=3,
                          group=None, device=torch.device("cpu"), rank=1, accumulation_steps=2,
                          budget=MemoryBudget(None, "none"))


def _profile(phase, ms, peak):
    return GraphProfile(0, phase, [NodeProfile("n", "t", time_ms=ms, peak_bytes=peak)])


def test_switch_peaks_are_final_only_after_the_verify_micro_step():
    driver = _driver()
    assert driver.last_switch() is None  # no switch yet
    sig = ("forward", (1, 2), 5)
    driver.report.planned(3, PLAIN, None, None, {sig: _profile("forward", 1.0, 700)}, None, {})
    driver._verify_pending = True
    assert driver.last_switch() is None  # the switched graphs are still to be measured
    driver._verify_pending = False
    assert driver.last_switch() == SwitchPeaks(3, 700, None)  # not measured: not a peak of 0
    driver.report.measured({sig: _profile("forward", 1.0, 900)})
    assert driver.last_switch() == SwitchPeaks(3, 700, 900)


def test_compute_comes_from_the_profile_else_from_the_timings():
    driver = _driver()
    report = StepReport(steps_per_print=0, wall_clock_breakdown=True, rank=1, device=torch.device("cpu"))
    assert report.phase_seconds() is None and measured_compute(driver, report, 2) is None
    report.totals_ms = {"forward": 40.0, "backward": 80.0, "step": 20.0}
    report._steps_in_window = 2
    assert report.phase_seconds() == PhaseSeconds(0.02, 0.04, 0.01)
    assert measured_compute(driver, report, 2) == (0.02, 0.04, 0.01, "wall_clock_breakdown")
    driver.profiles = {("forward",): _profile("forward", 3.0, 0), ("backward",): _profile("backward", 5.0, 0),
                       ("broken",): GraphProfile(1, "forward", [], complete=False)}
    f, b, s, source = measured_compute(driver, report, 2)  # one micro-step's op times, two per step
    assert (round(f, 6), round(b, 6), s, source) == (0.006, 0.01, 0.01, "profile")
    untimed = StepReport(steps_per_print=0, wall_clock_breakdown=False, rank=1, device=torch.device("cpu"))
    assert untimed.phase_seconds() is None and measured_compute(driver, untimed, 2)[2:] == (0.0, "profile")
