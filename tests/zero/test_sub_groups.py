"""ZeRO-3's optimizer step in sub-groups (``zero_optimization.sub_group_size``, zero/sub_groups.py)
and optimizer-state offload streaming that step (offload/opt_states.py).

Stepping in sub-groups must not change a single bit: each parameter is updated once by the same
element-wise arithmetic whichever tensors share the optimizer call, so runs with one sub-group and
with many are compared bitwise (and each against single-process training at the parity suites'
tolerance, so a bug breaking both alike still shows). What sub-groups change is memory: a
sub-group's gradient partitions are dropped right after it steps, and with offload at most two
sub-groups' offloaded state is on the device at a time. Both are checked while the step runs, by
wrapping the hooks the step calls.
"""

from __future__ import annotations

import pytest
import torch

from _harness import multiproc
from _harness.multiproc import run_distributed
from _harness.parity_cases import assert_parity, build_model, make_optimizer, run_steps, train_reference
from deepcompile.zero.sub_groups import split_sub_groups
from test_zero3_parity import FP32_TOL, INDUCTOR_TOL

pytestmark = pytest.mark.world_size(2)  # the world size in every test id (conftest.py)

# ---- splitting -----------------------------------------------------------------------------------


def test_sub_groups_run_in_reverse_registration_order_and_respect_the_size():
    sizes = [(0, 4), (1, 3), (2, 2), (3, 5), (4, 1)]
    assert split_sub_groups(sizes, 6) == [[4, 3], [2, 1], [0]]
    # One sub-group when everything fits; a parameter larger than the size is a sub-group alone.
    assert split_sub_groups(sizes, 100) == [[4, 3, 2, 1, 0]]
    assert split_sub_groups(sizes, 2) == [[4], [3], [2], [1], [0]]
    assert split_sub_groups([], 5) == []
    with pytest.raises(ValueError, match="at least 1"):
        split_sub_groups(sizes, 0)


# ---- training ------------------------------------------------------------------------------------

# The MLP's shards at 2 ranks have 46, 7, 33 and 3 elements (registration order): 40 makes the
# sub-groups [fc2.bias, fc2.weight], [fc1.bias], [fc1.weight].
SMALL = 40


def _config(sub_group_size=None, offload=False, budget=None):
    z = {"stage": 3, "reduce_bucket_size": 48, "stage3_param_persistence_threshold": 10}
    if sub_group_size is not None:
        z["sub_group_size"] = sub_group_size
    cfg = {"zero_optimization": z}
    if offload:
        z["offload_optimizer"] = {"device": "cpu"}
    if budget is not None:
        cfg["compile"] = {"memory_budget_bytes": budget}
    return cfg


def _train(ctx, name, cfg, backend, steps, after_step=None):
    import deepcompile

    torch._dynamo.reset()
    model = build_model(name, device=ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), cfg)
    if backend is not None:
        engine.compile(backend=backend)
    return run_steps(engine, name, steps, ctx.device, after_step=after_step), engine


def _watch_grads(engine, seen):
    """Wrap the step's hooks: before each sub-group, the earlier sub-groups' gradient partitions
    are gone and this one's are there."""
    from deepcompile import runtime

    inner = engine.sharding.sub_group_hooks

    class Watch:
        def before_sub_group(self, index, groups):
            seen.append(len(groups))
            for ids in groups[:index]:
                assert not any(runtime.holds_grad_target(i) for i in ids), ("kept", index, ids)
            assert all(runtime.holds_grad_target(i) for i in groups[index]), ("missing", index)
            if inner is not None:
                inner.before_sub_group(index, groups)

        def after_sub_group(self, index, groups):
            if inner is not None:
                inner.after_sub_group(index, groups)

    engine.sharding.sub_group_hooks = Watch()


def _parity_body(ctx, name, backend):
    base, engine = _train(ctx, name, _config(), backend, 4)
    assert len(engine.optimizer.last_sub_groups) == 1
    engine.destroy()
    seen = []

    def watch(engine, step):
        if step == 0:
            _watch_grads(engine, seen)

    got, engine = _train(ctx, name, _config(SMALL), backend, 4, after_step=watch)
    groups = engine.optimizer.last_sub_groups
    assert len(groups) >= 3 and max(len(g) for g in groups) >= 2, groups
    assert seen and min(seen) == len(groups)  # the watch saw every later step's sub-groups
    engine.destroy()
    assert got.losses == base.losses, (got.losses, base.losses)
    for key, value in base.params.items():
        assert torch.equal(got.params[key], value), key
    ref = train_reference(name, 4, device=ctx.device)
    assert_parity(got, ref, **(INDUCTOR_TOL if backend == "inductor" else FP32_TOL))


cpu_only = pytest.mark.skipif(multiproc.test_device_type() == "cuda",
                              reason="bitwise CPU parity; the GPU runs test_offload_gpu_*")


@cpu_only
@pytest.mark.parametrize("name,backend", [("mlp", "eager"), ("llama", "eager"), ("mlp", "inductor")])
def test_sub_group_step_is_bitwise_the_whole_step(name, backend):
    run_distributed(_parity_body, 2, args=(name, backend), timeout=300)


def _streaming_body(ctx):
    """Offload with several sub-groups: bitwise the plain run, and during the step at most the
    current and the next sub-group's offloaded state is on the device."""
    base, engine = _train(ctx, "mlp", _config(), "eager", 4)
    engine.destroy()
    on_device_at_step = []

    def watch(engine, step):
        if step != 0:
            return
        off = engine.offload
        inner_before = off.before_sub_group

        def before(index, groups):
            inner_before(index, groups)
            here = [j for j, ids in enumerate(groups)
                    if any(not u.on_host for i in ids for u in off.table.of(i))]
            on_device_at_step.append((index, here))
            assert set(here) <= {index, index + 1}, (index, here)
            assert index in here  # the sub-group about to step has its state

        engine.sharding.sub_group_hooks = type("W", (), {"before_sub_group": staticmethod(before),
                                                         "after_sub_group": off.after_sub_group})()

    got, engine = _train(ctx, "mlp", _config(SMALL, offload=True), "eager", 4, after_step=watch)
    groups = engine.optimizer.last_sub_groups
    assert len(groups) >= 3 and len(on_device_at_step) == 3 * len(groups)
    # Between steps everything is on the host again.
    assert all(u.on_host for u in engine.offload.units.values())
    engine.destroy()
    assert got.losses == base.losses
    for key, value in base.params.items():
        assert torch.equal(got.params[key], value), key


@cpu_only
def test_offload_streams_the_step_through_two_sub_groups():
    run_distributed(_streaming_body, 2, timeout=300)


def _window_body(ctx):
    """The smallest plan of a streamed step needs two consecutive sub-groups of state, not all."""
    from deepcompile.offload import device_memory
    from deepcompile.offload.plan import OffloadBudgetError

    saved = device_memory.peak_allocated, device_memory.allocated
    try:
        _, engine = _train(ctx, "mlp", _config(SMALL, offload=True), "eager", 1)
        # Adam's two fp32 moments per registered shard (padding included: the state is shaped
        # like the master shard).
        state = {sp.ds_id: 2 * 4 * sp.shard.numel() for sp in engine.sharding.params if sp.trainable}
        sizes = [sum(state[i] for i in ids) for ids in engine.optimizer.last_sub_groups]
        total = sum(state.values())
        engine.destroy()
        window = max(a + b for a, b in zip(sizes, sizes[1:] + [0]))
        assert window < total
        # Nothing else on the "device": the window is the whole minimum.
        device_memory.peak_allocated = lambda device: 1
        device_memory.allocated = lambda device: 0
        with pytest.raises(OffloadBudgetError, match=f"at least {window} bytes"):
            _train(ctx, "mlp", _config(SMALL, offload=True, budget=window - 1), "eager", 2)
        _, engine = _train(ctx, "mlp", _config(SMALL, offload=True, budget=window), "eager", 2)
        report = engine.offload.report()
        assert report["step_floor_bytes"] == window
        # Everything offloaded (no room beside the window): the step's floor is the peak.
        assert report["resident_bytes"] == 0 and report["predicted_peak_bytes"] == window
        assert report["copy_bandwidth"] is None  # no host-device link on a CPU device
        assert f"predicted peak {window} B" in engine.scheduler.report.text()
        engine.destroy()
    finally:
        device_memory.peak_allocated, device_memory.allocated = saved


@cpu_only
def test_streamed_step_needs_a_window_not_all_the_state():
    run_distributed(_window_body, 2, timeout=300)
