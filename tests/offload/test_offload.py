"""Optimizer-state offload (deepcompile/offload/): the plan, parity, freed device copies, bad input.

Parity is bitwise against the same engine without offload: offloading moves bytes and nothing
else (on CPU the "device" copy and the host buffer are distinct storages and the copies are
synchronous), so losses and parameters must be identical, not merely close. Each run is also
checked against single-process training at the tolerances of the parity suites, so a bug that
broke both runs alike would still show.

Between steps, every tensor the plan offloads must have an empty device storage (on CPU: the
working copy is released) and the host copy must hold its values.

The GPU test (marked ``gpu``) checks parity with no offload, memory after step 50 == after step 5,
and that device memory between steps excludes exactly the offloaded bytes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _harness import multiproc, offload_gpu
from _harness.multiproc import run_distributed
from _harness.parity_cases import GLOBAL_BATCH, assert_parity, batch, build_model, make_optimizer, run_steps, \
    train_reference
from deepcompile.offload.plan import OffloadBudgetError, check_budget, plan_offload
from test_zero3_parity import FP32_TOL, INDUCTOR_TOL

pytestmark = pytest.mark.world_size(2)  # the world size in every test id (conftest.py)

# ---- the plan alone ----------------------------------------------------------------------------


def test_plan_without_budget_offloads_everything():
    plan = plan_offload([5, 3, 8], keep_limit=None, min_fraction=0.0)
    assert plan.offloaded == [True, True, True] and plan.resident_bytes == 0 and plan.offloaded_bytes == 16


def test_plan_offloads_nothing_when_everything_fits():
    plan = plan_offload([5, 3, 8], keep_limit=16, min_fraction=0.0)
    assert plan.offloaded == [False, False, False] and plan.offloaded_bytes == 0


def test_plan_offloads_largest_first_and_finishes_with_the_smallest_that_covers():
    # 6 bytes over the limit: 8 is the only tensor that covers it alone.
    plan = plan_offload([5, 3, 8, 1], keep_limit=11, min_fraction=0.0)
    assert plan.offloaded == [False, False, True, False] and plan.resident_bytes == 9
    # 4 over: 5 covers it, and is smaller than 8.
    assert plan_offload([5, 3, 8, 1], keep_limit=13, min_fraction=0.0).offloaded == [True, False, False, False]
    # 12 over: no tensor covers it alone; 8 goes, then the 4 missing are covered by 5 (not 3 + 1).
    plan = plan_offload([5, 3, 8, 1], keep_limit=5, min_fraction=0.0)
    assert plan.offloaded == [True, False, True, False] and plan.offloaded_bytes == 13
    # Equal sizes: the first in the given (reload) order goes.
    assert plan_offload([4, 4, 3], keep_limit=7, min_fraction=0.0).offloaded == [True, False, False]
    # Exactly the total over: everything.
    assert plan_offload([4, 4, 3], keep_limit=0, min_fraction=0.0).offloaded == [True, True, True]


def test_plan_min_fraction_is_a_floor():
    # Half of 10 bytes at least: 4, then 2 covers the missing 1.
    plan = plan_offload([4, 4, 2], keep_limit=100, min_fraction=0.5)
    assert plan.offloaded_bytes == 6 and plan.offloaded == [True, False, True]
    assert plan_offload([4, 4, 2], keep_limit=100, min_fraction=1.0).offloaded == [True, True, True]


def test_budget_below_the_smallest_plan_names_the_minimum():
    with pytest.raises(OffloadBudgetError, match=r"needs 700 bytes.*at least 700 bytes"):
        check_budget(600, "compile.memory_budget_bytes", peak_without=500, step_floor=700)
    check_budget(700, "compile.memory_budget_bytes", peak_without=500, step_floor=700)
    check_budget(None, "none", peak_without=500, step_floor=700)


# ---- training with offload (distributed) ---------------------------------------------------------

OFFLOAD_KINDS = {
    # CPU device without a byte budget: everything offloadable is offloaded.
    "offload_opt_states": {"compile": {"offload_opt_states": True}},
    "offload_optimizer": {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}},
    # Half of the bytes at least (DeepSpeed's ratio): some tensors stay resident.
    "offload_optimizer_ratio": {"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
}


def _config(stage, kind, gas=1, budget=None):
    cfg = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 48, "stage3_param_persistence_threshold": 10},
           "gradient_accumulation_steps": gas}
    for section, values in OFFLOAD_KINDS.get(kind, {}).items():
        cfg.setdefault(section, {}).update(values)
    if budget is not None:
        cfg.setdefault("compile", {})["memory_budget_bytes"] = budget
    return cfg


def _train(ctx, name, cfg, backend, steps, gas=1, between_steps=None, optimizer="adamw"):
    """Train through deepcompile; ``between_steps(engine, step)`` runs after every optimizer step."""
    import deepcompile

    torch._dynamo.reset()
    model = build_model(name, device=ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters(), optimizer), cfg)
    if backend is not None:
        engine.compile(backend=backend)

    def after_step(engine, step):
        if between_steps is not None and (step + 1) % gas == 0:
            between_steps(engine, step)

    return run_steps(engine, name, steps, ctx.device, after_step=after_step), engine


def _check_offloaded_between_steps(expect_all: bool):
    def check(engine, step):
        off = engine.offload
        assert off is not None and off.plan is not None
        units = list(off.units.values())
        assert units, "optimizer-state offload found nothing to offload"
        out = [u for u in units if u.planned_out]
        assert out, "the plan offloaded nothing"
        if expect_all:
            assert len(out) == len(units)
        for u in units:
            # An offloaded tensor has no device bytes; a resident one has all of them.
            assert u.device_bytes.untyped_storage().nbytes() == (0 if u.planned_out else u.nbytes), off._label(u)
            assert u.on_host == u.planned_out
        report = engine.schedule_report()["optimizer_state_offload"]
        assert report["offloaded_bytes"] == sum(u.nbytes for u in out) > 0
        assert sum(t["offloaded"] for t in report["tensors"]) == len(out)

    return check


def _offload_parity_body(ctx, name, stage, backend, kind, steps, gas=1, optimizer="adamw"):
    base, engine = _train(ctx, name, _config(stage, None, gas), backend, steps, optimizer=optimizer)
    engine.destroy()
    got, engine = _train(ctx, name, _config(stage, kind, gas), backend, steps, gas,
                         between_steps=_check_offloaded_between_steps(expect_all=kind != "offload_optimizer_ratio"),
                         optimizer=optimizer)
    engine.destroy()
    # Bitwise: offload only moves bytes.
    assert got.losses == base.losses, (got.losses, base.losses)
    for key, value in base.params.items():
        assert torch.equal(got.params[key], value), key
    ref = train_reference(name, steps, gas=gas, device=ctx.device, optimizer=optimizer)
    assert_parity(got, ref, **(INDUCTOR_TOL if backend == "inductor" else FP32_TOL))


cpu_only = pytest.mark.skipif(multiproc.test_device_type() == "cuda",
                              reason="bitwise CPU parity; the gpu variant is test_offload_gpu_*")


# Every offload kind on every stage with the MLP; the tiny Llama (more parameters, of more shapes)
# once per stage family.
PARITY_CASES = [(stage, "mlp", kind) for stage in (1, 2, 3) for kind in sorted(OFFLOAD_KINDS)] + \
    [(3, "llama", "offload_opt_states"), (2, "llama", "offload_optimizer_ratio")]


@cpu_only
@pytest.mark.parametrize("stage,name,kind", PARITY_CASES)
def test_offload_parity(dist_world_size, stage, name, kind):
    backend = "eager"
    run_distributed(_offload_parity_body, dist_world_size, args=(name, stage, backend, kind, 4), timeout=300)


@cpu_only
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_parity_engine_without_compile_and_accumulation(stage):
    run_distributed(_offload_parity_body, 2, args=("mlp", stage, None, "offload_opt_states", 8), kwargs={"gas": 2})


@cpu_only
def test_offload_parity_sgd_momentum():
    """Optimizer-state offload of SGD's momentum buffers, with accumulation: SGD's update scales
    with the gradient, so a wrong gradient scale shows in the parameters (AdamW's would not)."""
    run_distributed(_offload_parity_body, 2, args=("mlp", 3, "eager", "offload_opt_states", 8),
                    kwargs={"gas": 2, "optimizer": "sgd_momentum"})


@cpu_only
def test_offload_parity_inductor():
    run_distributed(_offload_parity_body, 2, args=("mlp", 3, "inductor", "offload_optimizer", 4), timeout=300)


# ---- a budget: what stays, what is reloaded during the backward ---------------------------------


def _fake_peak(monkeypatch_peak):
    from deepcompile.offload import device_memory

    device_memory.peak_allocated = lambda device: monkeypatch_peak
    device_memory.allocated = lambda device: 0


def _budget_body(ctx, stage):
    from deepcompile.offload import device_memory
    from deepcompile.offload.opt_states import MASTER

    saved = device_memory.peak_allocated, device_memory.allocated
    try:
        # Learn the sizes of the offloadable tensors from a run that offloads all.
        _, engine = _train(ctx, "mlp", _config(stage, "offload_opt_states"), "eager", 1)
        units = engine.offload.units.values()
        sizes = sorted((u.nbytes for u in units), reverse=True)
        # ZeRO-1/2's master partitions are on the device when the peak is read: not part of it.
        peak_without = 5000 - sum(u.nbytes for u in units if u.what == MASTER)
        engine.destroy()
        total = sum(sizes)
        # A forward/backward peak of 5000 bytes (above what the step needs), and a budget that
        # keeps all but the largest tensor: exactly the largest is offloaded.
        _fake_peak(5000)
        budget = peak_without + total - sizes[0]
        base, engine = _train(ctx, "mlp", _config(stage, None), "eager", 4)
        engine.destroy()

        def check(engine, step):
            off = engine.offload
            out = [u for u in off.units.values() if u.planned_out]
            assert [u.nbytes for u in out] == [sizes[0]], [(off._label(u), u.nbytes) for u in off.units.values()]
            assert out[0].device_bytes.untyped_storage().nbytes() == 0
            assert off.plan.resident_bytes == total - sizes[0]
            # No headroom is left above the peak: nothing comes back during the backward.
            assert not any(u.early for u in off.units.values())

        got, engine = _train(ctx, "mlp", _config(stage, "offload_opt_states", budget=budget), "eager", 4,
                             between_steps=check)
        report = engine.schedule_report()["optimizer_state_offload"]
        assert report["budget_bytes"] == budget and report["peak_without_offloadable_bytes"] == peak_without
        # The decision is the joint plan's (the one all offload kinds share), here with optimizer
        # state alone: the same tensor, and its predicted transfer and exposure on the report.
        joint = engine.schedule_report()["offload_plan"]
        assert joint["planned"] and joint["history"], joint
        assert joint["kinds"]["optimizer_state"]["offloaded_bytes"] == sizes[0]
        assert joint["kinds"]["activation"]["offloaded_bytes"] == 0 and joint["predicted_transfer_ms_per_step"] > 0
        assert "optimizer-state offload (compile.offload_opt_states)" in engine.scheduler.report.text()
        engine.destroy()
        assert got.losses == base.losses

        # offload_optimizer with ratio 1 under a budget with headroom for the largest tensor: all
        # offloaded, and the largest reloaded from the start of the backward.
        def check_early(engine, step):
            off = engine.offload
            assert all(u.planned_out for u in off.units.values())
            early = [u.nbytes for u in off.units.values() if u.early]
            assert sum(early) <= sizes[0] and early, early

        cfg = _config(stage, "offload_optimizer", budget=peak_without + sizes[0])
        got, engine = _train(ctx, "mlp", cfg, "eager", 4, between_steps=check_early)
        engine.destroy()
        assert got.losses == base.losses
        for key, value in base.params.items():
            assert torch.equal(got.params[key], value), key

        # A budget below the smallest plan: every rank raises, naming the minimum (the peak, or
        # all the offloadable tensors at once for the step, whichever is larger).
        minimum = max(peak_without, total)
        with pytest.raises(OffloadBudgetError, match=f"at least {minimum} bytes"):
            _train(ctx, "mlp", _config(stage, "offload_opt_states", budget=minimum - 1), "eager", 2)
    finally:
        device_memory.peak_allocated, device_memory.allocated = saved


@cpu_only
@pytest.mark.parametrize("stage", [2, 3])
def test_offload_plan_under_a_budget(stage):
    run_distributed(_budget_body, 2, args=(stage,), timeout=300)


# ---- reading state between steps ----------------------------------------------------------------


def _state_access_body(ctx, stage):
    rank, world = dist.get_rank(), dist.get_world_size()
    n = GLOBAL_BATCH // world

    def one_more_step(e):
        a, b = batch("mlp", 3, device=ctx.device)
        e.backward(e(a[rank * n: (rank + 1) * n], b[rank * n: (rank + 1) * n]))
        e.step()

    # The run without offload first, to its end: one training engine per process at a time (a
    # second initialize replaces the runtime the first one's parameters are registered with).
    _, base_engine = _train(ctx, "mlp", _config(stage, None), "eager", 3)
    base_shards = [(s.name, s.local.detach().clone(),
                    {k: torch.as_tensor(v).clone() for k, v in base_engine.sharding.shard_optimizer_state(s.ds_id).items()})
                   for s in base_engine.sharding.shards()]
    one_more_step(base_engine)
    base_final = base_engine.full_state_dict(all_ranks=True)
    base_engine.destroy()
    _, engine = _train(ctx, "mlp", _config(stage, "offload_opt_states"), "eager", 3)
    away = engine.offload.offloaded_units()
    assert away, "nothing offloaded between steps"
    # Reading sharded state between steps reads the host copies (nothing comes back to the
    # device); the values are the optimizer's.
    for (name, local, state), b in zip(base_shards, engine.sharding.shards()):
        assert torch.equal(local, b.local), name
        sb = engine.sharding.shard_optimizer_state(b.ds_id)
        assert state.keys() == sb.keys()
        for key in state:
            assert torch.equal(state[key], torch.as_tensor(sb[key])), (name, key)
    assert engine.offload.offloaded_units() == away
    assert all(u.device_bytes.untyped_storage().nbytes() == 0 for u in away)
    # Training on continues identically, and the next step offloads again.
    one_more_step(engine)
    assert engine.offload.offloaded_units()
    offloaded_state = engine.full_state_dict(all_ranks=True)
    for key, value in base_final.items():
        assert torch.equal(offloaded_state[key], value), key
    engine.destroy()


@cpu_only
@pytest.mark.parametrize("stage", [2, 3])
def test_reading_sharded_state_between_steps(stage):
    run_distributed(_state_access_body, 2, args=(stage,))


# ---- bad input ----------------------------------------------------------------------------------


def _pinned_failure_body(ctx):
    from deepcompile.offload import host_memory

    original = host_memory.empty_host

    def fail_on_rank1(nbytes, pin):
        if dist.get_rank() == 1:
            raise host_memory.PinnedMemoryError(f"could not allocate {nbytes} bytes of pinned host memory: test")
        return original(nbytes, pin)

    host_memory.empty_host = fail_on_rank1
    try:
        with pytest.raises(host_memory.PinnedMemoryError) as e:
            _train(ctx, "mlp", _config(3, "offload_optimizer"), "eager", 2)
        where = "on this rank" if dist.get_rank() == 1 else "on another rank"
        assert "could not allocate its host buffers " + where in str(e.value), str(e.value)
    finally:
        host_memory.empty_host = original


@cpu_only
def test_pinned_allocation_failure_is_raised_on_every_rank():
    run_distributed(_pinned_failure_body, 2)


def test_nvme_is_refused():
    from deepcompile.config import Config, ConfigError

    with pytest.raises(ConfigError, match="offload_optimizer.device is 'nvme': NVMe offload is not implemented"):
        Config.from_any({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}})


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_applies_to_every_stage(stage):
    from deepcompile.config import Config
    from deepcompile.offload import opt_state_offload_settings

    cfg = Config.from_any(_config(stage, "offload_optimizer_ratio"))
    s = opt_state_offload_settings(cfg, torch.device("cpu"))
    assert s is not None and s.min_fraction == 0.5 and s.budget_bytes is None
    assert not s.pin_memory  # pinning needs a CUDA host: ordinary buffers on a CPU device
    assert opt_state_offload_settings(Config.from_any(_config(stage, None)), torch.device("cpu")) is None


# ---- GPU: parity, freed device memory, no growth -------------------------------------------------


def _gpu_body(ctx, stage: int, steps: int, early: int, sub_group_size=None):
    mem = offload_gpu.device_memory(ctx)
    offload = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if sub_group_size is not None:  # the step streams (ZeRO-3); the base run steps whole
        offload["sub_group_size"] = sub_group_size

    def at_early(engine):
        off = engine.offload
        units = list(off.units.values())
        assert units and all(u.on_host for u in units), [off._label(u) for u in units if not u.on_host]
        assert all(u.device_bytes.untyped_storage().nbytes() == 0 for u in units)
        report = off.report()
        # The link was measured (any real PCIe/NVLink-C2C host link moves > 1 GB/s) and the
        # prediction is the offloaded bytes over it.
        link = report["copy_bandwidth"]
        assert link["host_to_device"] > 1e9 and link["device_to_host"] > 1e9, link
        assert report["predicted_transfer_s_per_step"] == pytest.approx(
            max(report["offloaded_bytes"] / link["host_to_device"],
                report["offloaded_bytes"] / link["device_to_host"]))
        assert "predicted transfer per step" in engine.scheduler.report.text()
        return units

    base = offload_gpu.train_and_read(ctx, mem, {"stage": stage}, steps, early)
    got = offload_gpu.train_and_read(ctx, mem, offload, steps, early, at_early=at_early, no_sync_step=early + 2)
    offload_gpu.assert_parity_and_memory(base, got, steps, early)


@pytest.mark.world_size(multiproc.single_world_size())
@pytest.mark.gpu
@pytest.mark.parametrize("stage,sub_group_size", [(2, None), (3, None), (3, offload_gpu.GPU_SIZES["width"] ** 2)])
def test_offload_gpu_parity_and_memory(stage, sub_group_size):
    # With one layer's weight per sub-group the ZeRO-3 step streams through the copy lanes
    # (several sub-groups in flight on the device's streams) and must still be bitwise the same.
    run_distributed(_gpu_body, multiproc.single_world_size(), args=(stage, 50, 5, sub_group_size), timeout=600)
