"""The joint offload plan in training (deepcompile/offload/joint.py): activation, optimizer-state and
parameter offload on together under one ``compile.memory_budget_bytes``.

On a CPU device the device-memory readings are 0 (offload/device_memory.py), so the budget is
weighed against the candidates' own bytes and the plan's choice is exact arithmetic: a budget that
holds everything offloads nothing; below it the cheapest kind per byte goes first (optimizer state,
moved once each way per step; then activations; master shards, read at every gather, last; every
copy here hides behind the measured compute or is equally exposed); a budget of one byte offloads
everything. Each run is bitwise equal to the same engine without offload (the ops only move
bytes), the engine's state matches the report (activation plan, unit by unit), and the plan is
redone at the schedule switch, where the profile's op times appear.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from _harness import multiproc
from _harness.multiproc import run_distributed

cpu_only = pytest.mark.skipif(multiproc.test_device_type() == "cuda", reason="CPU arithmetic of the plan")
STEPS = 4
ROWS = 4096


class _Wide(nn.Module):
    """One saved activation of 4096 x 5 (80 KiB; the partitioner recomputes the rest) well above the
    step's window of two sub-groups of state (a few KiB of masters and Adam moments), so every
    kind can be the one that goes."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 64)
        self.fc2 = nn.Linear(64, 5)

    def forward(self, x, y):
        return ((self.fc2(torch.nn.functional.gelu(self.fc1(x))) - y) ** 2).mean()


def _config(budget=None, offload=True):
    cfg = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 0,
                                 "sub_group_size": 1000},
           # verify_plan: the switched schedule's first micro-step is profiled, so the joint plan
           # can read how far the switch moved the peak (without it nothing is measured there).
           "compile": {"warmup_steps": 2, "verify_plan": True},
           # The optimizer step's time, which hides the streamed step's reloads, is measured only
           # under wall_clock_breakdown (the forward and backward come from the profile).
           "wall_clock_breakdown": True}
    if offload:
        cfg["compile"].update({"offload_activation": True, "offload_opt_states": True, "offload_parameters": True,
                               "memory_budget_bytes": budget})
    return cfg


def _train(ctx, cfg, rows=ROWS, steps=STEPS, readings=None):
    """``readings``: a dict whose keys are step numbers; after those steps, the device memory
    allocated and the engine's host offload buffers are recorded in it."""
    import deepcompile

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Wide().to(ctx.device)
    engine = deepcompile.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg)
    engine.compile(backend="eager")
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(rows, 7, generator=g), torch.randn(rows, 5, generator=g)
        loss = engine(x.to(ctx.device), y.to(ctx.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if readings is not None and step + 1 in readings:
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            host = engine.offload.host_bytes() if engine.offload is not None else 0
            readings[step + 1] = (torch.cuda.memory_allocated(ctx.device) if ctx.device.type == "cuda" else 0, host)
    return losses, {k: v.clone() for k, v in engine.full_state_dict(all_ranks=True).items()}, engine


def _run(ctx, budget):
    from deepcompile.offload.opt_states import MASTER

    losses, params, engine = _train(ctx, _config(budget))
    report = engine.schedule_report()
    plan = report["offload_plan"]
    # The engine does what the report says: activation sites and units, byte by byte.
    o = engine.activations.offloader
    assert sum(o.stats[key].nbytes for key, _ in o.plan) == plan["kinds"]["activation"]["offloaded_bytes"]
    units = engine.offload.units.values()
    masters = sum(u.nbytes for u in units if u.planned_out and u.what == MASTER)
    state = sum(u.nbytes for u in units if u.planned_out and u.what != MASTER)
    assert (state, masters) == (plan["kinds"]["optimizer_state"]["offloaded_bytes"],
                                plan["kinds"]["master"]["offloaded_bytes"])
    assert all(u.on_host == u.planned_out for u in units)
    # The existing reports agree with the joint one.
    assert report["optimizer_state_offload"]["offloaded_bytes"] == state + masters
    assert report["activations"]["offloaded_bytes"] == plan["kinds"]["activation"]["offloaded_bytes"]
    reasons = [h["reason"] for h in plan["history"]]
    assert reasons[0].startswith("optimizer state planned after step 1"), reasons
    assert reasons[1] == "activation floor of two windows measured", reasons
    # warmup_steps 2: the schedule switched after step 2. Where prefetch and persistence moved the
    # peak its first micro-step measured (on CPU: the graphs' working set), the plan was redone.
    switch = engine.scheduler.report.current["graphs"]
    redone = [r for r in reasons if r.startswith("schedule switch at step 2: measured peak moved")]
    assert len(reasons) == 2 + len(redone), reasons
    plan["_redone"] = bool(redone)
    plan["_graphs"] = switch
    assert plan["compute_source"] == "profile" and plan["compute_s"]["forward"] > 0
    assert plan["predicted_transfer_ms_per_step"] >= plan["predicted_exposed_ms_per_step"] >= 0
    assert plan["predicted_peak_bytes"] <= budget
    assert "offload plan (joint)" in engine.scheduler.report.text()
    engine.destroy()
    return losses, params, plan


def _body(ctx):
    from deepcompile.offload.plan import OffloadBudgetError

    base_losses, base_params, engine = _train(ctx, _config(offload=False))
    engine.destroy()
    offloaded = {}

    def run(budget):
        losses, params, plan = _run(ctx, budget)
        # Bitwise: the offload ops and copies only move bytes.
        assert losses == base_losses, (budget, losses, base_losses)
        for k in base_params:
            assert torch.equal(params[k], base_params[k]), (budget, k)
        offloaded[budget] = {k: v["offloaded_bytes"] for k, v in plan["kinds"].items()}
        return plan

    roomy = run(1 << 40)
    # Nothing offloaded: the switch's prefetch (gathers launched ahead) and persistence moved the
    # forward's working set, and the plan was redone.
    assert roomy["_redone"], roomy["_graphs"]
    total = {k: v["resident_bytes"] for k, v in roomy["kinds"].items()}
    A, O, M = total["activation"], total["optimizer_state"], total["master"]
    S = roomy["step_floor_bytes"]  # the streamed step's window (device readings are 0 on CPU)
    assert A > S and O and M, (total, S)
    assert offloaded[1 << 40] == {"optimizer_state": 0, "activation": 0, "master": 0}
    # Half the optimizer state too much: only optimizer state goes (the least transfer per byte,
    # first among equals).
    got = run(A + O + M - O // 2) and offloaded[A + O + M - O // 2]
    assert O // 2 <= got["optimizer_state"] < O and got["activation"] == got["master"] == 0, got
    # All of it and half the activation too much: all optimizer state, then the activation (two
    # copies per byte; a master shard takes three, and all of them would not cover it), no master.
    budget = A // 2 + M
    run(budget)
    got = offloaded[budget]
    assert got == {"optimizer_state": O, "activation": A, "master": 0}, got
    # The step's window alone: every optimizer-state unit and master shard must go (the streamed
    # step holds them on top of its window), and the activation, larger than the window.
    run(S)
    got = offloaded[S]
    assert got == total, (got, total)
    # Below it no plan fits: a clear error naming the minimum.
    with pytest.raises(OffloadBudgetError, match=f"at least {S} bytes"):
        _train(ctx, _config(S - 1))


@pytest.mark.world_size(1)
@cpu_only
def test_joint_plan_choice_follows_the_budget():
    # One rank: the budgets above are computed from this rank's own candidates.
    run_distributed(_body, 1, timeout=900)


# ---- GPU ------------------------------------------------------------------------------------------

GPU_ROWS = 1 << 17  # the saved activation: 2.5 MiB, above the 1 MiB minimum of a GPU candidate
GPU_STEPS = 50  # the tight run: device memory and host buffers after step 50 equal those after step 5


def _gpu_body(ctx):
    base_losses, base_params, engine = _train(ctx, _config(offload=False), GPU_ROWS, GPU_STEPS)
    engine.destroy()
    plans = {}
    for name in ("roomy", "tight"):
        if name == "roomy":
            budget = 1 << 40
        else:
            # Half the optimizer state too much for the roomy plan's predicted peak (all ranks alike).
            r = plans["roomy"]
            budget = r["predicted_peak_bytes"] - r["kinds"]["optimizer_state"]["resident_bytes"] // 2
            t = torch.tensor([budget], device=ctx.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
            budget = int(t.item())
        # Each run's floors read the allocator's peak: not the previous run's.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        readings = {5: None, GPU_STEPS: None}
        losses, params, engine = _train(ctx, _config(budget), GPU_ROWS, GPU_STEPS, readings)
        plan = engine.schedule_report()["offload_plan"]
        # Nothing accumulates from step to step: not on the device, not in host buffers.
        assert readings[GPU_STEPS] == readings[5], (name, readings)
        print(f"rank {ctx.rank} {name}: {engine.scheduler.report.text()}", flush=True)
        engine.destroy()
        # The copies only move bytes, on streams ordered by events: bitwise (an MLP: no atomics).
        assert losses == base_losses, (name, losses, base_losses)
        for k in base_params:
            assert torch.equal(params[k], base_params[k]), (name, k)
        assert plan["link"]["host_to_device"] > 1e8 and plan["link"]["device_to_host"] > 1e8, plan["link"]
        assert plan["compute_source"] == "profile", plan
        plans[name] = plan
    roomy, tight = plans["roomy"], plans["tight"]
    assert sum(k["offloaded_bytes"] for k in roomy["kinds"].values()) == 0, roomy
    assert tight["kinds"]["optimizer_state"]["offloaded_bytes"] > 0, tight
    assert tight["predicted_peak_bytes"] <= tight["budget_bytes"], tight


@pytest.mark.world_size(multiproc.single_world_size())
@pytest.mark.gpu
def test_gpu_joint_plan_parity_and_choice():
    run_distributed(_gpu_body, multiproc.single_world_size(), timeout=600)
