"""Profile-guided scheduling: the schedule, the planners, the profiler, and training with them on.

Unit tests build small ATen graphs (no runtime); the distributed tests train on 2 ranks (gloo on
CPU, NCCL with DC_TEST_DEVICE=cuda) against single-process training.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

import deepcompile
from deepcompile.config import Config
from deepcompile.passes.prefetch import apply_prefetch
from deepcompile.passes.zero3 import insert_gather_release
from deepcompile.profiling.comm_model import CommModel
from deepcompile.profiling.graph_profiler import GraphProfile, NodeProfile
from deepcompile.scheduling.planner import graph_gathers, plan_persistent, plan_prefetch, reuse_distances
from deepcompile.scheduling.schedule import PassSchedule, ScheduleEntry
from _harness.multiproc import require_world_size, run_distributed, single_world_size
from _harness.parity_cases import GLOBAL_BATCH, assert_parity, train_engine, train_reference

pytestmark = pytest.mark.world_size(single_world_size())  # the world size in every test id (conftest.py)

dc = torch.ops.dc
INDUCTOR_TOL = dict(rtol=1e-4, atol=1e-5)
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
BF16_TOL = dict(rtol=3e-2, atol=3e-2)


def _z3(**compile_keys):
    return {
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 10,
                              "stage3_prefetch_bucket_size": 40},
        "compile": compile_keys,
    }


# ---- the schedule -----------------------------------------------------------------------------


def test_default_schedule_is_plain_then_passes_after_warmup():
    s = PassSchedule.from_config(Config.from_dict(_z3(warmup_steps=3)))
    assert s.entry_at(0).passes == frozenset() and s.entry_at(2).passes == frozenset()
    assert s.entry_at(3).passes == {"prefetch", "selective_gather"}
    # Resume-safe: fires on step >= entry, also far past it.
    assert s.entry_at(1000).passes == {"prefetch", "selective_gather"}
    only_prefetch = PassSchedule.from_config(Config.from_dict(_z3(warmup_steps=3, selective_gather=False)))
    assert only_prefetch.entry_at(5).passes == {"prefetch"}
    assert PassSchedule.from_config(Config.from_dict(_z3(prefetch=False, selective_gather=False))).entries == []
    z1 = Config.from_dict({"zero_optimization": {"stage": 1}})
    assert PassSchedule.from_config(z1).entries == []


def test_user_schedule_without_step_zero_entry_starts_plain():
    cfg = Config.from_dict(_z3(schedule=[{"step": 4, "passes": ["prefetch"]}, {"step": 9, "passes": []}]))
    s = PassSchedule.from_config(cfg)
    assert s.entry_at(0).passes == frozenset()
    assert s.entry_at(4).passes == {"prefetch"} and s.entry_at(8).passes == {"prefetch"}
    assert s.entry_at(9).passes == frozenset()
    assert s.next_after(4) == ScheduleEntry(9, frozenset())


@pytest.mark.parametrize(
    "schedule,match",
    [
        ("prefetch", "must be a list"),
        ([{"step": 1}], "needs both 'step' and 'passes'"),
        ([{"step": -1, "passes": []}], r"compile.schedule\[0\].step must be a non-negative integer"),
        ([{"step": 1, "passes": ["prefetch"]}, {"step": 1, "passes": []}], "appears twice"),
        ([{"step": 1, "passes": ["offload"]}], "unknown pass 'offload'"),
        ([{"step": 1, "passes": [], "when": 2}], "unknown config key 'compile.schedule\\[0\\].when'"),
    ],
)
def test_schedule_config_errors(schedule, match):
    with pytest.raises(ValueError, match=match):
        Config.from_dict(_z3(schedule=schedule))


def test_memory_budget_bytes_is_validated():
    assert Config.from_dict(_z3(memory_budget_bytes=1 << 20)).compile.memory_budget_bytes == 1 << 20
    with pytest.raises(ValueError, match="compile.memory_budget_bytes must be a positive integer"):
        Config.from_dict(_z3(memory_budget_bytes=0))


# ---- planners on small graphs -----------------------------------------------------------------


def _three_layer_graph():
    def f(w1, w2, w3, x):
        h = torch.relu(x @ w1.t())
        h = torch.relu(h @ w2.to(torch.bfloat16).float().t())
        return (h @ w3.t()).sum()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(5, 3), torch.randn(5, 5), torch.randn(2, 5), torch.randn(4, 3))
    params = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder") if i < 3}
    insert_gather_release(gm, graph_id=3, params=params)
    return gm


def _flat_profile(gm, peak: int) -> GraphProfile:
    return GraphProfile(1, "forward", [NodeProfile(n.name, str(n.target), 1.0, 0, peak, peak) for n in gm.graph.nodes])


# Latency-bound: every gather up to 1 KiB costs the same 1 ms, then 1 ms per KiB.
LATENCY_BOUND = CommModel([(64, 1.0), (1024, 1.0), (1 << 20, 1024.0)])
# Bandwidth-bound: time proportional to size from the smallest point on.
BANDWIDTH_BOUND = CommModel([(4, 1.0), (1 << 20, float(1 << 18))])


def _no_use_before_wait(gm):
    """Every reader of a gathered parameter comes after its wait, and prefetches precede gathers."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    waits = {n.args[2]: n for n in gm.graph.nodes if n.target is dc.wait_allgather.default}
    for n in gm.graph.nodes:
        if n.target is dc.prefetch_params_fused.default:
            for ds_id in n.args[2]:
                gather = next(g for g in gm.graph.nodes if g.target is dc.allgather_param.default and g.args[2] == ds_id)
                assert order[n] < order[gather]
        for a in n.all_input_nodes:
            if a.op == "placeholder" and n.target not in (dc.allgather_param.default, dc.prefetch_params_fused.default):
                idx = [p for p in gm.graph.nodes if p.op == "placeholder"].index(a)
                assert idx not in waits, f"{n} reads parameter {a} without its gather"


def test_fusion_counts_the_launch_cost_a_fast_link_hides():
    """On a link that moves a layer's weights faster than the runtime launches a group (2 x H200:
    a 23 MB gather in about 80 us), every gather looked bandwidth-bound and went alone: 163
    groups a step through Trainer. With the launch cost counted, such gathers share groups up to
    the size cap, while gathers that take far longer than a launch still do not."""
    from deepcompile.scheduling import planner

    fast = CommModel([(1 << p, max(0.02, (1 << p) / 300e6)) for p in range(16, 29, 2)])  # 20 us floor, 300 GB/s
    hidden, inter = 2048, 5632
    layer = [hidden * hidden] * 4 + [hidden * inter] * 3
    gathers = [planner.Gather(None, i, n, torch.bfloat16) for i, n in enumerate(layer * 4)]
    # 28 groups without the launch cost; at least 8 with it (each 51M-element layer spans two 5e7 groups)
    assert len(planner._fuse(gathers, int(5e7), fast)) <= 12
    slow = CommModel([(1 << p, (1 << p) / 3e6) for p in range(16, 29, 2)])  # 3 GB/s: every gather >> a launch
    assert len(planner._fuse(gathers, int(5e7), slow)) == len(gathers)


def test_guided_prefetch_fuses_latency_bound_gathers_and_keeps_dtypes():
    gm = _three_layer_graph()
    plan = plan_prefetch(gm, 1000, profile=_flat_profile(gm, 0), comm=LATENCY_BOUND, budget_bytes=1 << 30)
    assert plan.guided and [len(g.gathers) for g in plan.groups] == [3]
    apply_prefetch(gm, 3, plan)
    (pf,) = [n for n in gm.graph.nodes if n.target is dc.prefetch_params_fused.default]
    assert pf.args[2] == [0, 1, 2] and pf.kwargs["dtypes"] == [torch.float32, torch.bfloat16, torch.float32]
    _no_use_before_wait(gm)


def test_guided_prefetch_does_not_fuse_bandwidth_bound_gathers():
    gm = _three_layer_graph()
    plan = plan_prefetch(gm, 1000, profile=_flat_profile(gm, 0), comm=BANDWIDTH_BOUND, budget_bytes=1 << 30)
    assert [len(g.gathers) for g in plan.groups] == [1, 1, 1]
    assert all(g.ahead for g in plan.groups)
    apply_prefetch(gm, 3, plan)
    _no_use_before_wait(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    gathers = {n.args[2]: n for n in gm.graph.nodes if n.target is dc.allgather_param.default}
    prefetch = {n.args[2][0]: n for n in gm.graph.nodes if n.target is dc.prefetch_params_fused.default}
    # Group k+1 is launched at the start of group k: before group k's gather.
    assert order[prefetch[1]] < order[gathers[0]] and order[prefetch[2]] < order[gathers[1]]


def test_guided_prefetch_respects_the_memory_budget():
    gm = _three_layer_graph()
    sizes = [g.nbytes for g in graph_gathers(gm)]  # w1 60 B, w2 50 B (bf16), w3 40 B
    peak = 1000
    # Room for one more 60 B group beyond the profiled peak: w1 (60) and w3 (40) go ahead,
    # then w2 (50) ... all fit; with 45 B of room only w3 (40) goes ahead.
    roomy = plan_prefetch(gm, 1, profile=_flat_profile(gm, peak), comm=BANDWIDTH_BOUND, budget_bytes=peak + 60)
    assert [g.ahead for g in roomy.groups] == [True, True, True]
    assert roomy.predicted_peak_bytes == peak + max(sizes)
    tight = plan_prefetch(gm, 1, profile=_flat_profile(gm, peak), comm=BANDWIDTH_BOUND, budget_bytes=peak + 45)
    assert [g.ahead for g in tight.groups] == [False, False, True]
    assert tight.predicted_peak_bytes <= peak + 45
    # A group that does not go ahead is launched right before its own gather.
    for g in tight.groups:
        if not g.ahead:
            assert g.launch_before == g.gathers[0].node.name
    apply_prefetch(gm, 3, tight)
    _no_use_before_wait(gm)


def test_persistent_parameters_are_still_prefetched_but_cost_no_budget():
    # Persistent parameters are stale after every optimizer step and refilled by their first
    # gather; leaving them out of the prefetch plan would expose every refill in the forward.
    gm = _three_layer_graph()
    peak = 1000
    plan = plan_prefetch(gm, 1, resident=[0, 1], profile=_flat_profile(gm, peak), comm=BANDWIDTH_BOUND,
                         budget_bytes=peak + 45)
    assert [g.gathers[0].ds_id for g in plan.groups] == [0, 1, 2]
    assert all(g.ahead for g in plan.groups)  # w1 and w2 keep their buffers; w3 (40 B) fits in 45 B
    assert plan.max_ahead_bytes == 40


def test_persistent_plan_ranks_by_time_per_byte_and_respects_the_budget():
    gm = _three_layer_graph()
    gathers = graph_gathers(gm)  # 60, 50, 40 bytes
    prof = _flat_profile(gm, 1000)
    # Latency-bound: all cost 1 ms, so the smallest saves most per byte.
    plan = plan_persistent([gathers, gathers], [prof], LATENCY_BOUND, budget_bytes=1000 + 95,
                           micro_steps_per_step=1)
    assert plan.ids == [2, 1]  # 40 B then 50 B fit in 95 B; 60 B does not
    assert plan.predicted_peak_bytes <= 1095
    # Gradient accumulation multiplies the gathers saved.
    acc = plan_persistent([gathers, gathers], [prof], LATENCY_BOUND, 1095, micro_steps_per_step=4)
    assert [c.saved_ms for c in acc.chosen] == [7.0, 7.0]
    # Already persistent parameters are not candidates; an incomplete profile plans nothing.
    assert 2 not in plan_persistent([gathers], [prof], LATENCY_BOUND, 1 << 30, 1, already=[2]).ids
    broken = GraphProfile(1, "forward", [], complete=False)
    empty = plan_persistent([gathers], [broken], LATENCY_BOUND, 1 << 30, 1)
    assert empty.ids == [] and "incomplete" in empty.skipped_reason


def _ahead(plan):
    return [(g.ahead, g.launch_before) for g in plan.groups]


def test_prefetch_keeps_to_max_live_parameters():
    # DeepSpeed's stage3_max_live_parameters: the elements held beyond the op in flight (the
    # group launched ahead plus those kept gathered) stay within the limit.
    gm = _three_layer_graph()
    assert [g.numel for g in graph_gathers(gm)] == [15, 25, 10]
    peak = 1000

    def plan(**limits):
        return plan_prefetch(gm, 1, profile=_flat_profile(gm, peak), comm=BANDWIDTH_BOUND, budget_bytes=1 << 30,
                             **limits)

    free = plan()
    assert [g.ahead for g in free.groups] == [True, True, True] and free.peak_live_numel == 25
    capped = plan(max_live_numel=24)  # below the unconstrained plan's 25: w2 is gathered at its use
    assert [g.ahead for g in capped.groups] == [True, False, True]
    assert capped.peak_live_numel == 15 <= 24
    # Kept-gathered elements count too: 10 kept leave room for w3 (10) only.
    kept = plan(max_live_numel=24, kept_numel=10)
    assert [g.ahead for g in kept.groups] == [False, False, True] and kept.peak_live_numel == 20
    # A limit at or above the unconstrained peak changes nothing.
    for roomy in (25, 10**9):
        same = plan(max_live_numel=roomy)
        assert _ahead(same) == _ahead(free) and same.predicted_peak_bytes == free.predicted_peak_bytes
    # The static plan (no profile) keeps to it as well.
    static = plan_prefetch(gm, 1, max_live_numel=12)
    assert [g.ahead for g in static.groups] == [False, False, True]
    apply_prefetch(gm, 3, capped)
    _no_use_before_wait(gm)


def test_reuse_distance_counts_the_elements_gathered_in_between():
    gathers = graph_gathers(_three_layer_graph())  # w1 15, w2 25, w3 10 elements
    # forward then backward: w1 w2 w3 | w1 w2 w3
    assert reuse_distances([gathers, gathers], 1) == {0: 35, 1: 25, 2: 40}
    # One graph, used once per micro-step: only accumulation reuses it (after the others' 35, 25, 40).
    assert reuse_distances([gathers], 1) == {}
    assert reuse_distances([gathers], 2) == {0: 35, 1: 25, 2: 40}
    # A parameter never released adds nothing between the others' uses.
    assert reuse_distances([gathers, gathers], 1, skip=[1]) == {0: 10, 2: 15}


def test_persistent_plan_keeps_to_the_live_and_reuse_limits():
    gm = _three_layer_graph()
    gathers = graph_gathers(gm)
    prof = _flat_profile(gm, 1000)

    def plan(**limits):
        return plan_persistent([gathers, gathers], [prof], LATENCY_BOUND, None, 1, **limits)

    free = plan()
    assert free.ids == [2, 1, 0] and free.peak_live_numel == 50
    # stage3_max_reuse_distance: w3 is reused 40 elements later, w1 35, w2 25.
    assert plan(max_reuse_numel=35).ids == [1, 0]
    below = plan(max_reuse_numel=34)
    assert below.ids == [1] and below.beyond_reuse == 2 and below.chosen[0].reuse_numel == 25
    assert "reuse distance" in plan(max_reuse_numel=24).skipped_reason
    # stage3_max_live_parameters: 5 elements prefetched ahead + w3 (10) + w1 (15) = 30; w2 (25) does not fit.
    live = plan(max_live_numel=30, prefetch_extra_numel=5)
    assert live.ids == [2, 0] and live.peak_live_numel == 30
    # Limits at or above the unconstrained plan's change nothing.
    assert plan(max_live_numel=50, max_reuse_numel=40).ids == free.ids


def test_comm_model_interpolates_and_extrapolates():
    m = CommModel([(1024, 1.0), (2048, 2.0), (4096, 3.0)])
    assert m.predict_ms(0) == 0.0
    assert m.predict_ms(100) == 1.0  # latency floor
    assert m.predict_ms(1536) == pytest.approx(1.5)
    assert m.predict_ms(8192) == pytest.approx(5.0)  # last slope continued


# ---- distributed: training with the passes on ---------------------------------------------------


def _train_with_passes(ctx, name, backend, steps, config, bf16=False, tol=None):
    dtype = torch.bfloat16 if bf16 else torch.float32
    got, engine = train_engine(name, steps, config, backend, ctx.device, dtype=dtype)
    ref = train_reference(name, steps, gas=config.get("gradient_accumulation_steps", 1), device=ctx.device)
    assert_parity(got, ref, **tol)
    report = engine.schedule_report()
    persistent = [c for c in engine.scheduler.chosen_persistent]
    engine.destroy()
    return report, persistent


def _parity_with_passes_body(ctx, name, backend, gas, bf16):
    cfg = _z3(warmup_steps=2)
    cfg["gradient_accumulation_steps"] = gas
    tol = BF16_TOL if bf16 else INDUCTOR_TOL if backend == "inductor" else FP32_TOL
    report, _ = _train_with_passes(ctx, name, backend, 4 * gas + 2, cfg, bf16=bf16, tol=tol)
    assert report and report["entry"] == "step 2: prefetch, selective_gather"
    assert report["graphs"], "nothing was profiled"
    assert all(g["profile_complete"] for g in report["graphs"])
    # Every rank took the same decisions.
    mine = json.dumps(report, sort_keys=True, default=str)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    assert all(r == mine for r in everyone), "ranks planned differently"


@pytest.mark.parametrize(
    "name,backend,gas,bf16",
    [
        ("mlp", "eager", 1, False),
        ("mlp", "inductor", 1, False),
        ("graph_break", "eager", 1, False),
        ("mlp", "eager", 4, False),
        # Inductor with accumulation: the profiled micro-step defers the compile, the next runs compiled.
        ("mlp", "inductor", 2, False),
        ("tied", "eager", 1, False),
        ("lora", "eager", 1, False),
        ("partly_disabled", "eager", 1, False),
        ("llama", "inductor", 1, False),
        ("mlp", "eager", 1, True),
    ],
)
def test_parity_with_prefetch_and_selective_gather(name, backend, gas, bf16):
    run_distributed(_parity_with_passes_body, world_size=single_world_size(), args=(name, backend, gas, bf16), timeout=300)


def _budget_body(ctx, tmpdir):
    # A budget just above the profiled working set: nothing can be kept persistent, and the
    # plan is still correct.
    cfg = _z3(warmup_steps=1, memory_budget_bytes=1, report_dir=tmpdir, verify_plan=True)
    report, persistent = _train_with_passes(ctx, "mlp", "eager", 4, cfg, tol=FP32_TOL)
    assert persistent == [] and report["persistent"] == []
    assert report["persistent_note"] == "nothing fits in the budget"
    for g in report["graphs"]:
        for group in g["prefetch"] or []:
            assert not group["ahead"], "a prefetch went ahead although the budget has no room"
    if ctx.rank == 0:
        files = sorted(os.listdir(tmpdir))
        assert files == ["schedule_step1.json", "schedule_step1.txt"], files
        with open(os.path.join(tmpdir, "schedule_step1.json")) as f:
            written = json.load(f)
        assert written["budget_bytes"] == 1
        assert all(g["measured_peak_bytes"] is not None for g in written["graphs"])
    else:
        assert not os.path.exists(os.path.join(tmpdir, "rank1"))


def test_memory_budget_is_respected_and_the_report_is_written(tmp_path):
    run_distributed(_budget_body, world_size=single_world_size(), args=(str(tmp_path),))


def _predicted_vs_measured_body(ctx):
    cfg = _z3(warmup_steps=1, prefetch=False, verify_plan=True)
    report, persistent = _train_with_passes(ctx, "mlp", "eager", 4, cfg, tol=FP32_TOL)
    assert persistent, "with a roomy budget selective unsharding keeps something gathered"
    for g in report["graphs"]:
        assert g["measured_peak_bytes"] is not None
        if ctx.device.type == "cpu":
            # CPU working sets are exact byte counts: the prediction bounds the measurement.
            assert g["measured_peak_bytes"] <= g["predicted_peak_bytes"], g


def test_selective_gather_prediction_bounds_the_measured_peak():
    run_distributed(_predicted_vs_measured_body, world_size=single_world_size())


def _max_live_body(ctx):
    # The MLP's partitioned parameters: fc1.weight 91 elements, fc1.bias 13, fc2.weight 65 (fc2.bias
    # is below the persistence threshold). A limit of 80 leaves fc1.weight gathered at its use only.
    cfg = _z3(warmup_steps=1)
    cfg["zero_optimization"]["stage3_max_live_parameters"] = 80
    report, persistent = _train_with_passes(ctx, "mlp", "eager", 4, cfg, tol=FP32_TOL)
    live = report["live_parameters"]
    assert live["max_live_parameters"] == 80 and 0 < live["planned_peak_numel"] <= 80, live
    assert sum(p["numel"] for p in report["persistent"]) <= 80
    assert all(g["live_numel"] is not None and g["live_numel"] <= 80 for g in report["graphs"])
    assert not any(p["param"].endswith("fc1.weight") for p in report["persistent"])
    groups = [grp for g in report["graphs"] for grp in g["prefetch"] or []]
    assert groups, "nothing was planned"
    for grp in groups:
        if any(name.endswith("fc1.weight") for name in grp["params"]):
            assert not grp["ahead"], grp


def test_max_live_parameters_bounds_the_plan():
    run_distributed(_max_live_body, world_size=single_world_size())


def _resume_body(ctx):
    import deepcompile
    from _harness.parity_cases import batch, build_model, make_optimizer

    torch._dynamo.reset()
    model = build_model("mlp", device=ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), _z3(warmup_steps=5))
    engine.compile(backend="eager")
    engine.global_steps = 7  # as if resumed from a checkpoint past the warm-up
    n = GLOBAL_BATCH // ctx.world_size
    for step in range(3):
        x, y = batch("mlp", step, device=ctx.device)
        engine.backward(engine(x[ctx.rank * n:(ctx.rank + 1) * n], y[ctx.rank * n:(ctx.rank + 1) * n]))
        engine.step()
        if step == 0:
            # First step: plain graphs, profiled; the due entry applies from the next step.
            assert engine.scheduler.applied.passes == {"prefetch", "selective_gather"}
            assert engine.schedule_report()["step"] == 8
    engine.destroy()


def test_schedule_is_resume_safe():
    run_distributed(_resume_body, world_size=single_world_size())


def _profile_failure_body(ctx, node_kind):
    import deepcompile
    from _harness.parity_cases import batch, build_model, make_optimizer

    torch._dynamo.reset()
    model = build_model("mlp", device=ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), _z3(warmup_steps=1))
    engine.compile(backend="eager")
    n = GLOBAL_BATCH // ctx.world_size
    losses = []
    ref = train_reference("mlp", 3, device=ctx.device)

    def one_step(step):
        x, y = batch("mlp", step, device=ctx.device)
        loss = engine(x[ctx.rank * n:(ctx.rank + 1) * n], y[ctx.rank * n:(ctx.rank + 1) * n])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)

    if ctx.rank == 1:
        # Step 0 is profiled (warmup_steps 1). Fail on rank 1 only, at a compute node of the
        # forward (`gelu`, between two gathers) or of the backward after two gradients were
        # already reduced (`gelu_backward`).
        engine.scheduler.fail_at = {"forward": "gelu", "backward": "gelu_backward"}[node_kind]
    if node_kind == "forward":
        one_step(0)  # aborted on both ranks, finished by the compiled graph
        engine.scheduler.fail_at = None
        one_step(1)
        one_step(2)
        profiles = list(engine.scheduler.profiles.values())
        assert profiles and any(not p.complete for p in profiles), "the failure was not recorded"
        assert losses == pytest.approx(ref.losses, rel=1e-5), (losses, ref.losses)
    else:
        with pytest.raises(RuntimeError, match="cannot be finished"):
            one_step(0)
    engine.destroy()


@pytest.mark.world_size(2)
@pytest.mark.parametrize("node_kind", ["forward", "backward"])
def test_a_rank_failing_while_profiling_does_not_hang_the_others(node_kind):
    require_world_size(2)  # one rank fails, the other must not hang
    run_distributed(_profile_failure_body, world_size=2, args=(node_kind,), timeout=120)


def _destroy_releases_state_body(ctx, warmup_steps):
    import gc
    import weakref

    import deepcompile
    from _harness.parity_cases import batch, build_model, make_optimizer

    torch._dynamo.reset()

    def train_and_destroy():
        model = build_model("mlp", device=ctx.device)
        engine = deepcompile.initialize(model, make_optimizer(model.parameters()), _z3(warmup_steps=warmup_steps))
        engine.compile(backend="eager")
        n = GLOBAL_BATCH // ctx.world_size
        for step in range(3):
            x, y = batch("mlp", step, device=ctx.device)
            loss = engine(x[ctx.rank * n:(ctx.rank + 1) * n], y[ctx.rank * n:(ctx.rank + 1) * n])
            engine.backward(loss)
            engine.step()
        grads = engine.sharding.optimizer.grads()
        assert not grads, "gradient partitions outlived the optimizer step"
        adam = [t for state in engine.sharding.optimizer.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        engine.destroy()
        return weakref.ref(engine), weakref.ref(max(adam, key=lambda t: t.numel())), loss

    engine_ref, grads_ref, last_loss = train_and_destroy()
    gc.collect()
    # Compiled code outlives the engine (Dynamo's cache, the last loss's autograd graph), but must
    # not keep the engine's tensors alive: a benchmark or a job building a second engine would
    # otherwise carry the first one's optimizer state.
    assert grads_ref() is None, "the optimizer state survived engine.destroy()"
    assert engine_ref() is None, "the engine survived engine.destroy()"
    del last_loss
    torch._dynamo.reset()


@pytest.mark.parametrize("warmup_steps", [1, 5])  # with and without a schedule switch
def test_destroy_releases_the_engine_state(warmup_steps):
    run_distributed(_destroy_releases_state_body, world_size=single_world_size(), args=(warmup_steps,))


def test_compiled_halves_stay_boxed_through_torch_wrappers():
    """aot_autograd calls a compiled half with one argument list only when the callable it holds
    has ``_boxed_call``; torch wraps our halves (``torch._dynamo.disable`` uses functools.wraps),
    so the flag must travel in the instance ``__dict__``, and nothing else may (the driver would
    keep the engine alive through the wrapper)."""
    import gc
    import weakref

    import torch

    from deepcompile.compiler.backend import _ProfiledCallable
    from deepcompile.scheduling.instance_chain import InstanceChain

    class Driver:
        def track(self, obj):
            pass

        mode = None  # no micro-step is profiled
        chain = InstanceChain()  # no prefetch across graphs

        def wants_profile(self, signature):
            return False

    seen = []

    def compiled(args):
        seen.append(type(args))
        args.clear()  # what Inductor's code does, so that inputs can be freed early

    driver = Driver()
    half = _ProfiledCallable(compiled, None, ("sig",), None, driver, graph_arg=1)
    wrapped = torch._dynamo.disable(half, reason="test")
    assert getattr(wrapped, "_boxed_call", False) is True
    args = [torch.zeros(1), torch.ones(1)]
    wrapped(args)
    assert seen == [list] and args == [], "the argument list was not handed through (and cleared)"
    assert set(vars(half)) == {"_boxed_call"} and set(vars(wrapped)) >= {"_boxed_call"}
    ref = weakref.ref(driver)
    half.detach()
    del driver
    gc.collect()
    assert ref() is None, "a wrapper kept the driver alive"


# ---- re-planning in place (compiler/replan.py) ------------------------------------------------


def _steps(engine, ctx, steps, start=0):
    from _harness.parity_cases import batch

    n = GLOBAL_BATCH // ctx.world_size
    losses = []
    for step in range(start, start + steps):
        x, y = batch("mlp", step, device=ctx.device)
        loss = engine(x[ctx.rank * n:(ctx.rank + 1) * n], y[ctx.rank * n:(ctx.rank + 1) * n])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
    return losses


def _replan_in_place_body(ctx, verify):
    import torch._inductor.compile_fx as compile_fx
    from torch._dynamo.utils import counters

    from _harness.parity_cases import build_model, make_optimizer

    torch._dynamo.reset()
    compiles = []
    real = compile_fx.compile_fx_inner

    def counting(gm, inputs, **kwargs):
        compiles.append("backward" if kwargs.get("is_backward") else "forward")
        return real(gm, inputs, **kwargs)

    compile_fx.compile_fx_inner = counting
    try:
        counters.clear()
        model = build_model("mlp", device=ctx.device)
        engine = deepcompile.initialize(model, make_optimizer(model.parameters()), _z3(warmup_steps=1, verify_plan=verify))
        engine.compile(backend="inductor")
        losses = _steps(engine, ctx, 1)
        traced = counters["stats"]["unique_graphs"]
        assert traced >= 1
        # Step 0 ran every graph through the profiler and the plan switched after it: the plain
        # graphs were never compiled by Inductor.
        assert engine.scheduler.applied.passes == {"prefetch", "selective_gather"}
        assert compiles == [], compiles
        halves = engine.scheduler.live_halves()
        assert halves and all(h.compiled is None for h in halves)
        assert all(any(n.target is dc.prefetch_params_fused.default for n in h.gm.graph.nodes)
                   for h in halves if graph_gathers(h.plan.base)), "a graph with gathers got no prefetch"
        if verify:
            losses += _steps(engine, ctx, 1, start=1)  # profiled again (the plan is measured)
            assert compiles == []
            losses += _steps(engine, ctx, 2, start=2)
        else:
            losses += _steps(engine, ctx, 1, start=1)  # the first step that runs the plan compiled
            assert sorted(compiles) == sorted(h.plan.phase for h in halves), compiles
            losses += _steps(engine, ctx, 2, start=2)
        # Nothing was traced again; each half was compiled once, with its plan.
        assert counters["stats"]["unique_graphs"] == traced
        assert sorted(compiles) == sorted(h.plan.phase for h in halves), compiles
        assert all(h.compiled is not None for h in halves)
        engine.destroy()
    finally:
        compile_fx.compile_fx_inner = real
    ref = train_reference("mlp", 4, device=ctx.device)
    # Inductor's fused kernels sum in another order than the eager reference: the tolerance of
    # the Inductor parity tests above.
    assert losses == pytest.approx(ref.losses, rel=INDUCTOR_TOL["rtol"], abs=INDUCTOR_TOL["atol"]), (losses, ref.losses)


@pytest.mark.parametrize("verify", [False, True], ids=["default", "verify_plan"])
def test_replan_keeps_the_traced_graphs_and_compiles_each_half_once(verify):
    run_distributed(_replan_in_place_body, world_size=single_world_size(), args=(verify,), timeout=300)


def _unchanged_plan_body(ctx):
    from _harness.parity_cases import build_model, make_optimizer

    torch._dynamo.reset()
    model = build_model("mlp", device=ctx.device)
    # selective unsharding alone changes no graph: every half keeps its compiled code.
    cfg = _z3(schedule=[{"step": 0, "passes": []}, {"step": 2, "passes": ["selective_gather"]}])
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), cfg)
    engine.compile(backend="eager")
    losses = _steps(engine, ctx, 1)
    before = {id(h): (h.compiled, h.gm) for h in engine.scheduler.live_halves()}
    losses += _steps(engine, ctx, 1, start=1)  # profiled; the plan switches after it
    assert engine.scheduler.applied.passes == {"selective_gather"}
    after = {id(h): (h.compiled, h.gm) for h in engine.scheduler.live_halves()}
    assert before and after == before, "a half whose graph did not change was replaced"
    losses += _steps(engine, ctx, 2, start=2)
    engine.destroy()
    ref = train_reference("mlp", 4, device=ctx.device)
    # Same fp32 kernels in another order (partitioned reduction): the eager parity tolerance.
    assert losses == pytest.approx(ref.losses, rel=FP32_TOL["rtol"], abs=FP32_TOL["atol"]), (losses, ref.losses)


def test_replan_keeps_halves_whose_graph_the_plan_does_not_change():
    run_distributed(_unchanged_plan_body, world_size=single_world_size())


def test_a_later_forward_compile_keeps_the_strides_its_backward_expects():
    from deepcompile.compiler.replan import _with_strides

    x = torch.arange(6.0).reshape(2, 3)
    compiled = lambda args: [args[0].t(), args[0] + 1]  # noqa: E731 -- output 0 is transposed (strides (1, 3))
    fixed = _with_strides(compiled, [(2, 1), (3, 1)], [(1, 3), (3, 1)], graph_id=1)
    out = fixed([x])
    assert out[0].stride() == (2, 1) and torch.equal(out[0], x.t())
    assert out[1].stride() == (3, 1) and torch.equal(out[1], x + 1)
    # Nothing differs (or the strides are unknown): the code is used as it is.
    assert _with_strides(compiled, [(1, 3), None], [(1, 3), (3, 1)], graph_id=1) is compiled
    assert _with_strides(compiled, [(2, 1), (3, 1)], None, graph_id=1) is compiled
