"""The training loop's parts (deepcompile/parts.py): which exist for a config, and the order of
their hooks, stated once here. A change of order changes when offload plans are redone against
when the kinds act on them, or what the step's timings cover: it must be deliberate."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from deepcompile import debug_checks, parts
from deepcompile.memory.budget import MemoryBudget
from deepcompile.scheduling.report import ScheduleReport
from deepcompile.step_report import StepReport

# With every feature on: each hook, the parts that act there, in call order.
EVERY_FEATURE = ["step_report", "debug_checks", "joint_offload", "backward_step", "optimizer_state_offload",
                 "activations"]
HOOK_ORDER = {
    "begin_micro_step": ["activations"],
    "before_forward": ["step_report", "joint_offload"],
    "before_backward": ["step_report", "backward_step", "optimizer_state_offload"],
    "after_backward": ["debug_checks"],
    "at_boundary": ["debug_checks"],
    "before_step": ["joint_offload", "optimizer_state_offload", "activations"],
    "after_update": ["optimizer_state_offload"],
    "after_step": ["step_report"],
    "enter_phase": ["step_report"],
    "exit_phase": ["step_report"],
    "report": ["joint_offload", "optimizer_state_offload", "activations"],
    "close": ["debug_checks", "optimizer_state_offload", "activations"],
}


class _Feature:
    """Stands in for an offload kind; records what the loop asked of it."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls
        self.offload = True  # the activation side takes part in the joint plan
        self.side = self  # optimizer-state offload's planning side (offload/opt_state_plan.py)

    def __getattr__(self, method):
        if method.startswith("__"):
            raise AttributeError(method)
        return lambda *a, **k: self.calls.append(f"{self.name}.{method}") or {"from": self.name}


def _build(monkeypatch, every=True):
    calls = []
    monkeypatch.setattr(parts, "optimizer_state_offload",
                        lambda *a: _Feature("offload", calls) if every else None)
    monkeypatch.setattr(parts, "activation_memory",
                        lambda *a, **k: _Feature("activations", calls) if every else None)
    monkeypatch.setattr(parts, "memory_planner",
                        lambda units, act, *a: _Feature("planner", calls) if units is not None else None)
    config = SimpleNamespace(gradient_accumulation_steps=2, compile=SimpleNamespace(debug_checks=every))
    sharding = SimpleNamespace(backward_step=_Feature("backward_step", calls) if every else None,
                               param_names=lambda: {0: "w"})
    report = StepReport(steps_per_print=10**9, wall_clock_breakdown=False, rank=0, device=torch.device("cpu"))
    built = parts.build_parts(config, sharding=sharding, schedule=SimpleNamespace(), step_report=report,
                              device=torch.device("cpu"), group=None, budget=MemoryBudget(None, "none"),
                              loss_scaling=False)
    return built, calls


def test_the_order_of_every_hook_with_every_feature_on(monkeypatch):
    built, _ = _build(monkeypatch)
    try:
        assert [p.name for p in built] == EVERY_FEATURE
        assert parts.hook_order(built) == HOOK_ORDER
        assert set(parts.HOOKS) == set(HOOK_ORDER)
    finally:
        for p in built:
            if p.name == "debug_checks":
                p.close()
    assert debug_checks.LEDGER is None  # the ledger is installed while the engine lives, and only then


def test_the_engine_calls_the_hooks_of_a_point_in_order(monkeypatch):
    built, calls = _build(monkeypatch)
    try:
        moment = parts.Moment(global_steps=1, boundary=True)
        for hook in parts.hooks_at(built)["before_step"]:
            hook(moment)
        # The planner redoes the plan before the kinds act; it plans the activations at their point
        # (after optimizer-state offload's before_step), when they report to it.
        assert calls == ["planner.at_schedule_switch", "offload.before_step", "planner.at_activation_window"]
        calls.clear()
        for hook in parts.hooks_at(built)["after_update"]:
            hook(moment)
        # The offload finds what the step did, the planner decides, then the units are written back.
        assert calls == ["offload.after_step", "planner.after_state_change", "offload.write_back"]
        calls.clear()
        for hook in parts.hooks_at(built)["before_backward"]:
            hook(moment, torch.tensor(1.0), None)
        assert calls == ["backward_step.begin_backward", "offload.before_backward"]
    finally:
        for hook in parts.hooks_at(built)["close"]:
            hook()


def test_features_off_leave_the_step_report_alone(monkeypatch):
    built, _ = _build(monkeypatch, every=False)
    assert [p.name for p in built] == ["step_report"]


def test_parts_add_their_sections_to_the_schedule_report(monkeypatch):
    built, _ = _build(monkeypatch)
    try:
        schedule = ScheduleReport(SimpleNamespace(report_dir=None, debug_log=False, verify_plan=True), 0, {})
        schedule.contributors = built
        sections = schedule.as_dict()
        assert sections == {"offload_plan": {"from": "planner"}, "optimizer_state_offload": {"from": "offload"},
                            "activations": {"from": "activations"}}
    finally:
        for hook in parts.hooks_at(built)["close"]:
            hook()
