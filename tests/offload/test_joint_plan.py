"""The joint offload plan (deepcompile/offload/joint_plan.py): pure arithmetic, no engine."""

from __future__ import annotations

import pytest

from deepcompile.offload.joint_plan import (ACTIVATION, MASTER, OPTIMIZER_STATE, Candidate, ComputeTimes, Link,
                                            exposed_seconds, plan_jointly)
from deepcompile.offload.plan import OffloadBudgetError

LINK = Link(host_to_device=100.0, device_to_host=100.0)  # bytes per second: easy arithmetic
PLENTY = ComputeTimes(forward_s=1e6, backward_s=1e6, step_s=1e6)
NONE = ComputeTimes()


def _kinds(plan, cands):
    return [c.kind for c, out in zip(cands, plan.offloaded) if out]


def test_plenty_of_compute_cheapest_per_byte_first():
    # Two micro-steps: an activation moves twice per optimizer step, optimizer state once, a master
    # shard is read at every gather (4 times) and written back once. With everything hidden, the
    # least transfer per byte decides: optimizer state, then activations, then masters.
    cands = [Candidate("m", MASTER, 100), Candidate("a", ACTIVATION, 100), Candidate("o", OPTIMIZER_STATE, 100)]
    plan = plan_jointly(cands, budget=1000 + 200, fb_floor=1000, step_floor=0, streams=True, link=LINK,
                        compute=PLENTY, micro_steps=2)
    assert _kinds(plan, cands) == [OPTIMIZER_STATE]
    plan = plan_jointly(cands, budget=1000 + 100, fb_floor=1000, step_floor=0, streams=True, link=LINK,
                        compute=PLENTY, micro_steps=2)
    assert _kinds(plan, cands) == [ACTIVATION, OPTIMIZER_STATE]
    assert plan.exposed_total_s == 0.0
    # Transfer per step: optimizer state 100 B each way; activations 100 B each way twice.
    assert plan.transfer_s[OPTIMIZER_STATE] == pytest.approx(2.0)
    assert plan.transfer_s[ACTIVATION] == pytest.approx(4.0)
    assert plan.offloaded_bytes == {OPTIMIZER_STATE: 100, ACTIVATION: 100, MASTER: 0}
    assert plan.predicted_fb_peak == 1100


def test_a_kind_whose_copies_cannot_hide_loses_to_one_whose_copies_do():
    # One micro-step: an activation and optimizer state cost the same transfer per byte, and
    # optimizer state wins ties. Under ZeRO-1/2 (no streamed step) the step waits for every reload
    # that could not start in the backward, and a budget met exactly leaves no headroom to start
    # any there: 1000 B of optimizer state would expose its whole 10 s reload, while the
    # activation's copies (10 s each way) hide in the 20 s forward and backward.
    cands = [Candidate("o", OPTIMIZER_STATE, 1000), Candidate("a", ACTIVATION, 1000)]
    compute = ComputeTimes(forward_s=20.0, backward_s=20.0, step_s=0.0)
    plan = plan_jointly(cands, budget=1000, fb_floor=0, step_floor=0, streams=False, link=LINK, compute=compute)
    assert _kinds(plan, cands) == [ACTIVATION]
    assert plan.exposed_total_s == 0.0
    # The same with a streamed step long enough to hide the reload: the tie goes to optimizer state.
    plan = plan_jointly(cands, budget=1000, fb_floor=0, step_floor=0, streams=True, link=LINK,
                        compute=ComputeTimes(forward_s=20.0, backward_s=20.0, step_s=10.0))
    assert _kinds(plan, cands) == [OPTIMIZER_STATE]
    assert plan.exposed_total_s == 0.0
    # Activation offload off: the optimizer state goes, and its reload is predicted exposed.
    cands = [Candidate("o", OPTIMIZER_STATE, 1000), Candidate("a", ACTIVATION, 1000, eligible=False)]
    plan = plan_jointly(cands, budget=1000, fb_floor=0, step_floor=0, streams=False, link=LINK, compute=compute)
    assert _kinds(plan, cands) == [OPTIMIZER_STATE]
    assert plan.exposed_total_s == pytest.approx(10.0) and plan.exposed_s[OPTIMIZER_STATE] == pytest.approx(10.0)


def test_nothing_hides_least_transfer_per_byte_wins():
    # No compute measured: every copy is exposed; the master (3 copies per byte per step) loses to
    # the activation (2) although the master alone would finish the plan.
    cands = [Candidate("m", MASTER, 500), Candidate("a1", ACTIVATION, 300), Candidate("a2", ACTIVATION, 300)]
    plan = plan_jointly(cands, budget=500, fb_floor=0, step_floor=0, streams=True, link=LINK, compute=NONE)
    assert _kinds(plan, cands) == [ACTIVATION, ACTIVATION]
    assert plan.exposed_total_s == pytest.approx(exposed_seconds({ACTIVATION: 600}, LINK, NONE))
    assert plan.exposed_s[ACTIVATION] == pytest.approx(plan.exposed_total_s)
    assert plan.exposed_s[MASTER] == 0.0


def test_the_step_peak_is_lowered_only_by_what_the_step_holds():
    # Streamed step (ZeRO-3): resident optimizer state counts against the step's peak (800 B floor
    # + 800 B of state > 1400), activations do not. First the step: the smallest optimizer-state
    # unit that alone fits it (o1); then the forward/backward (still 200 B over): all copies hide,
    # optimizer state wins the tie, and o2 is the only one left of its kind.
    cands = [Candidate("a", ACTIVATION, 1000), Candidate("o1", OPTIMIZER_STATE, 200),
             Candidate("o2", OPTIMIZER_STATE, 600)]
    plan = plan_jointly(cands, budget=1400, fb_floor=0, step_floor=800, streams=True, link=LINK, compute=PLENTY)
    assert plan.offloaded == [False, True, True]
    assert plan.predicted_step_peak == 800 and plan.predicted_fb_peak == 1000
    # Not streamed (ZeRO-1/2): the step floor already holds every unit, reloaded; only the
    # forward/backward (400 B over) is planned for. o2 alone would cover it but leave 200 B of
    # headroom, so 400 B of its reload could not start in the backward and would be exposed (the
    # step waits for it): the activation, whose copies hide, goes instead.
    plan = plan_jointly(cands, budget=1400, fb_floor=0, step_floor=800, streams=False, link=LINK, compute=PLENTY)
    assert plan.offloaded == [True, False, False]
    assert plan.predicted_step_peak == 800 and plan.predicted_fb_peak == 800 and plan.exposed_total_s == 0.0


def test_infeasible_budget_names_the_minimum():
    cands = [Candidate("a", ACTIVATION, 100), Candidate("o", OPTIMIZER_STATE, 300, eligible=False)]
    with pytest.raises(OffloadBudgetError, match="at least 1300 bytes"):
        plan_jointly(cands, budget=1299, fb_floor=1000, step_floor=0, streams=True, link=LINK, compute=PLENTY)
    plan = plan_jointly(cands, budget=1300, fb_floor=1000, step_floor=0, streams=True, link=LINK, compute=PLENTY)
    assert plan.offloaded == [True, False] and plan.headroom == 0


def test_forced_and_ratio_and_no_budget():
    cands = [Candidate("m", MASTER, 50, forced=True), Candidate("o1", OPTIMIZER_STATE, 70),
             Candidate("o2", OPTIMIZER_STATE, 30), Candidate("a", ACTIVATION, 10)]
    # A generous budget: the forced master goes, and half the optimizer state (ratio 0.5: the 70 B).
    plan = plan_jointly(cands, budget=10**9, fb_floor=0, step_floor=0, streams=True, link=LINK, compute=PLENTY,
                        min_state_fraction=0.5)
    assert plan.offloaded == [True, True, False, False]
    # No budget: every eligible candidate goes.
    plan = plan_jointly(cands, budget=None, fb_floor=0, step_floor=0, streams=True, link=LINK, compute=PLENTY)
    assert all(plan.offloaded) and plan.headroom is None


def test_exposure_model_per_phase():
    # 100 B of activations per micro-step, two micro-steps, forward 1 s, backward 3 s: the
    # offloads take 2 s in the forward (1 s exposed), the reloads 2 s in the backward (hidden).
    assert exposed_seconds({ACTIVATION: 100}, LINK, ComputeTimes(1.0, 3.0, 0.0), micro_steps=2) == pytest.approx(1.0)
    # 100 B of optimizer state: write-back 1 s hides in the forward, reload 1 s in a 0.5 s
    # backward plus 0.25 s step: 0.25 s exposed.
    assert exposed_seconds({OPTIMIZER_STATE: 100}, LINK, ComputeTimes(1.0, 0.5, 0.25)) == pytest.approx(0.25)


def test_activations_placed_in_their_phases():
    # 100 B at 100 B/s: one second each way; a 10 s forward and backward (one micro-step).
    compute = ComputeTimes(forward_s=10.0, backward_s=10.0, step_s=0.0)
    moved = {ACTIVATION: 100}
    # Computed at the start of the forward, needed at the end of the backward: hidden.
    assert exposed_seconds(moved, LINK, compute, activations=[(100, 0.0)]) == 0.0
    # Computed at 95 % of the forward: the offload runs 0.5 s past its end, and the backward needs
    # the tensor after 0.5 s, half a second before its reload can be done.
    assert exposed_seconds(moved, LINK, compute, activations=[(100, 0.95)]) == pytest.approx(1.0)
    # Without positions, each phase's total against the phase: hidden either way.
    assert exposed_seconds(moved, LINK, compute) == 0.0
    # Two late tensors, at 90 % and 95 %: the second offload queues behind the first and ends 1 s
    # after the forward; in the backward the first reload keeps it waiting 0.5 s, and the second,
    # queued behind it, 0.5 s more.
    two = [(100, 0.9), (100, 0.95)]
    assert exposed_seconds({ACTIVATION: 200}, LINK, compute, activations=two) == pytest.approx(1.0 + 1.0)
    # At 80 % and 90 % both copies fit between their tensors and the phases' ends.
    assert exposed_seconds({ACTIVATION: 200}, LINK, compute, activations=[(100, 0.8), (100, 0.9)]) == pytest.approx(0.0, abs=1e-9)


def test_the_plan_offloads_the_activations_computed_early():
    # Two equal activations; the budget needs one of them off the device. The one computed at 90 %
    # of the forward is needed 0.2 s into the backward and its copies (1 s each) cannot hide; the
    # one computed at 10 % has 1.8 s of forward and of backward for them.
    compute = ComputeTimes(forward_s=2.0, backward_s=2.0, step_s=0.0)
    late, early = Candidate("late", ACTIVATION, 100, position=0.9), Candidate("early", ACTIVATION, 100, position=0.1)
    plan = plan_jointly([late, early], budget=100, fb_floor=0, step_floor=0, streams=True, link=LINK,
                        compute=compute)
    assert plan.offloaded == [False, True] and plan.exposed_total_s == 0.0
    # Positions unknown (0 for both): the first of equals goes, as before.
    plan = plan_jointly([Candidate("a", ACTIVATION, 100), Candidate("b", ACTIVATION, 100)], budget=100, fb_floor=0,
                        step_floor=0, streams=True, link=LINK, compute=compute)
    assert plan.offloaded == [True, False]
