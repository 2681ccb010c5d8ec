"""compile.debug_checks: the checks pass on correct training and name the fault on broken runs."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import deepcompile  # noqa: F401  (loads torch.ops.dc)
from deepcompile import debug_checks
from deepcompile.passes.zero3 import insert_gather_release
from _harness.multiproc import run_distributed, single_world_size
from _harness.parity_cases import assert_parity, train_engine, train_reference

WORLD = single_world_size()
pytestmark = pytest.mark.world_size(WORLD)  # the world size in every test id (conftest.py)
INDUCTOR_TOL = dict(rtol=1e-4, atol=1e-5)
FP32_TOL = dict(rtol=1e-5, atol=1e-6)


def _config(stage, gas=1):
    cfg = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 64}, "gradient_accumulation_steps": gas,
           "compile": {"debug_checks": True}}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return cfg


def _clean_body(ctx, name, stage, backend, gas):
    steps = 2 * gas
    got, engine = train_engine(name, steps, _config(stage, gas), backend, ctx.device)
    ledger = engine._ledger
    assert ledger is not None and debug_checks.LEDGER is ledger
    assert ledger.windows_checked == steps // gas  # the check ran at every optimizer step
    ref = train_reference(name, steps, gas=gas, device=ctx.device)
    assert_parity(got, ref, **(INDUCTOR_TOL if backend == "inductor" else FP32_TOL))
    engine.destroy()
    assert debug_checks.LEDGER is None


@pytest.mark.parametrize("name,stage,backend,gas", [
    ("partly_disabled", 3, "eager", 2),  # a compiled graph and an eager frame reduce into one window
    ("graph_break", 3, "inductor", 1),
    ("tied", 2, "eager", 2),
    ("mlp", 1, "inductor", 2),
])
def test_checks_pass_on_correct_training(name, stage, backend, gas):
    run_distributed(_clean_body, WORLD, args=(name, stage, backend, gas), timeout=600)


def _dropped_reduction_body(ctx):
    """A compiler that drops one reduce_grad (as a stale Inductor cache entry once did)."""
    import deepcompile.compiler.pipeline as pipeline_mod  # the backend runs its passes from there

    original = pipeline_mod.insert_reductions

    def drop_first(gm, graph_id, grad_slots):
        reductions = original(gm, graph_id, grad_slots)
        victim = reductions[0]
        victim.replace_all_uses_with(victim.args[0])  # end_backward now depends on the gradient itself
        gm.graph.erase_node(victim)
        return reductions

    pipeline_mod.insert_reductions = drop_first
    try:
        with pytest.raises(debug_checks.DebugCheckError, match=r"1 gradient\(s\) produced, 0 reduced"):
            train_engine("mlp", 1, _config(3), "eager", ctx.device)
    finally:
        pipeline_mod.insert_reductions = original
        debug_checks.install(None)


def test_a_dropped_reduction_is_caught():
    run_distributed(_dropped_reduction_body, WORLD, timeout=300)


def _nan_loss_body(ctx):
    import deepcompile
    import torch.nn as nn

    model = nn.Linear(3, 1).to(ctx.device)
    engine = deepcompile.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), _config(3))
    try:
        loss = engine(torch.full((2, 3), float("nan"), device=ctx.device)).sum()
        with pytest.raises(debug_checks.DebugCheckError, match="the loss not finite"):
            engine.backward(loss)
    finally:
        engine.destroy()


def test_a_nan_loss_is_caught():
    run_distributed(_nan_loss_body, WORLD, timeout=300)


def test_a_graph_reading_placeholder_data_is_caught():
    def f(w, x):
        return (x @ w.t()).sum() + w.sum()

    placeholder = torch.full((1, 1), float("nan")).expand(5, 3)
    gm = make_fx(f, tracing_mode="fake")(placeholder, torch.randn(4, 3))
    w = next(n for n in gm.graph.nodes if n.op == "placeholder")
    params = {w: 0}
    insert_gather_release(gm, graph_id=1, params=params)
    debug_checks.check_placeholders_only_gathered(gm, params, {0: "fc.weight"}, "forward")  # all uses gathered
    # A use the pass did not replace (what a bug in a pass would leave behind).
    with gm.graph.inserting_after(w):
        stray = gm.graph.call_function(torch.ops.aten.sum.default, (w,))
    with pytest.raises(debug_checks.DebugCheckError, match=r"fc.weight is read by .*sum"):
        debug_checks.check_placeholders_only_gathered(gm, params, {0: "fc.weight"}, "forward")
    gm.graph.erase_node(stray)


def test_ledger_counts_by_window():
    ledger = debug_checks.ReductionLedger({0: "a", 1: "b"})
    ledger.produced([0, 1])
    ledger.produced([0])
    ledger.check_window({0: 2, 1: 1})
    ledger.produced([1])
    with pytest.raises(debug_checks.DebugCheckError, match="b: 1 gradient.* produced, 2 reduced"):
        ledger.check_window({1: 2})
    assert ledger.windows_checked == 2
