"""Gradient side of the ``torch.ops.dc`` runtime, on 2 and 3 ranks against an eager reference.

``reduce_grad`` + ``end_backward`` for ZeRO stages 1, 2 and 3: each rank's gradient target must
equal its slice of ``all_reduce(grad) / world``, with buckets that overflow and grow, mixed fp32 /
bf16 gradients, accumulation windows, a parameter shared by two graphs, the ZeRO-3 padding tail,
gradients cast to the expected dtype, and ZeRO-1's step-local gradient targets.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from deepcompile import runtime
from deepcompile.runtime import RuntimeConfig
from _harness.multiproc import require_world_size, run_distributed
from _harness.runtime_reference import (
    GRAPH, GRAPH2, CONFIG, TINY_BUCKET, FP32_SPECS, MIXED_SPECS, STAGES, numel_of, full_param, rank_grad,
    averaged_full_grad, z12_layout, z12_overlap, register_params, check_target, reduce_step,
)

ops = torch.ops.dc


def reduce_and_check(ctx, params, step, what, release_buckets=True):
    """One update-step backward through reduce_grad + end_backward; every target must equal
    this rank's slice of the averaged gradient."""
    runtime.start_backward(True)
    refs = reduce_step(ctx, params, GRAPH, step=step, release_buckets=release_buckets)
    for i, p in params.items():
        check_target(p, p.expected(refs[i]), what)


def _body_reduce_reference(ctx, stage):
    """Each rank's target after reduce_grad + end_backward equals the eager reference: this
    rank's slice of all_reduce(grad) / world."""
    ctx.init_runtime(CONFIG)
    params = register_params(ctx, stage, FP32_SPECS)
    runtime.register_graph(GRAPH, list(params), stage)
    reduce_and_check(ctx, params, 1, f"stage {stage}")


@pytest.mark.parametrize("stage", STAGES)
def test_reduce_matches_reference(dist_world_size, stage):
    run_distributed(_body_reduce_reference, dist_world_size, args=(stage,))


def _body_reduce_tiny_bucket_mixed(ctx, stage):
    """reduce_bucket_size=8 elements: most gradients do not fit (the bucket grows) and the
    others overflow it (flushes mid-backward); fp32 and bf16 gradients share one backward."""
    ctx.init_runtime(TINY_BUCKET)
    params = register_params(ctx, stage, MIXED_SPECS)
    runtime.register_graph(GRAPH, list(params), stage)

    reduce_and_check(ctx, params, 1, f"stage {stage} step 1", release_buckets=False)
    # Buckets were kept (release_reduce_buckets=False) and grew past the configured 8 elements.
    biggest = max(p.numel for p in params.values())
    assert runtime.reduce_bucket_numel() >= biggest, (
        f"reduce buckets hold {runtime.reduce_bucket_numel()} elements, a {biggest}-element gradient was reduced"
    )

    # The next update step starts a new window: targets hold only its gradients.
    reduce_and_check(ctx, params, 2, f"stage {stage} step 2")


@pytest.mark.parametrize("stage", STAGES)
def test_reduce_tiny_bucket_mixed_dtypes(dist_world_size, stage):
    run_distributed(_body_reduce_tiny_bucket_mixed, dist_world_size, args=(stage,))


def _body_reduce_accumulation(ctx, stage):
    """Two accumulation windows of two micro-steps. The target of a window = sum of its
    micro-steps' averaged gradients; the first reduction of a window overwrites. Every backward
    releases the buckets (as the last graph of a step does), so the non-update backward after an
    update step runs on released buckets: DeepSpeed's ZeRO-1 aborted there."""
    ctx.init_runtime(CONFIG)
    params = register_params(ctx, stage, FP32_SPECS)
    runtime.register_graph(GRAPH, list(params), stage)

    for window, (s1, s2) in enumerate([(1, 2), (3, 4)]):
        runtime.start_backward(False)
        r1 = reduce_step(ctx, params, GRAPH, step=s1)
        if stage != 1:  # ZeRO-2/3 reduce every micro-step; ZeRO-1 only at the update step
            for i, p in params.items():
                check_target(p, p.expected(r1[i]), f"stage {stage} window {window} micro-step 1")
        runtime.start_backward(True)
        r2 = reduce_step(ctx, params, GRAPH, step=s2)
        for i, p in params.items():
            check_target(p, p.expected(r1[i] + r2[i]), f"stage {stage} window {window} update step")


@pytest.mark.parametrize("stage", STAGES)
def test_reduce_accumulation_windows(dist_world_size, stage):
    run_distributed(_body_reduce_accumulation, dist_world_size, args=(stage,))


def _body_reduce_two_graphs(ctx, stage):
    """A parameter used by two graphs (two frames sharing a weight) is reduced by both backwards
    of one step: its target gets the SUM (in DeepSpeed the second graph's reduction overwrote the
    first's)."""
    ctx.init_runtime(CONFIG)
    params = register_params(ctx, stage, FP32_SPECS)
    A, B, C = 11, 23, 40
    runtime.register_graph(GRAPH, [A, B], stage)
    runtime.register_graph(GRAPH2, [A, C], stage)

    for step in range(2):  # the second update step must not accumulate onto the first
        runtime.start_backward(True)
        # Backward graphs run in reverse frame order; the last one releases the buckets.
        r2 = reduce_step(ctx, params, GRAPH2, step=10 * step + 1, ids=[A, C], release_buckets=False)
        r1 = reduce_step(ctx, params, GRAPH, step=10 * step + 2, ids=[A, B], release_buckets=True)
        check_target(params[A], params[A].expected(r1[A] + r2[A]), f"stage {stage} step {step} shared param")
        check_target(params[B], params[B].expected(r1[B]), f"stage {stage} step {step}")
        check_target(params[C], params[C].expected(r2[C]), f"stage {stage} step {step}")


@pytest.mark.parametrize("stage", STAGES)
def test_reduce_param_shared_by_two_graphs(dist_world_size, stage):
    run_distributed(_body_reduce_two_graphs, dist_world_size, args=(stage,))


def _body_z3_padding_tail(ctx):
    """ZeRO-3 with uneven numels packed in one bucket: the last rank's padding tail must be
    exactly zero (DeepSpeed's reduce read past each gradient's slot in the send buffer, into the
    next gradient or stale bucket bytes).
    A first step with large gradients leaves stale data in the kept bucket; targets start out
    holding a sentinel, which the first reduction of the window must overwrite."""
    ctx.init_runtime(RuntimeConfig(reduce_bucket_size=64))
    specs = [(5, (1,), torch.float32), (23, (7,), torch.float32), (11, (5, 3), torch.float32), (8, (2, 5), torch.float32)]
    params = register_params(ctx, 3, specs)
    for p in params.values():
        p.target.fill_(12345.0)
    runtime.register_graph(GRAPH, list(params), 3)

    runtime.start_backward(True)
    ids = list(params)
    grads = {i: 1000.0 * rank_grad(i, params[i].shape, ctx.rank, 7, torch.float32, ctx.device) for i in ids}
    refs = {i: averaged_full_grad(g) for i, g in grads.items()}
    outs = [ops.reduce_grad(grads[i], GRAPH, i) for i in ids]
    ops.end_backward(outs, GRAPH, False)
    for i, p in params.items():
        check_target(p, p.expected(refs[i]), "large-gradient step")

    runtime.start_backward(True)
    refs = reduce_step(ctx, params, GRAPH, step=1, release_buckets=False)
    for i, p in params.items():
        check_target(p, p.expected(refs[i]), "second step (stale bucket)")


def test_z3_padding_tail_is_zero(dist_world_size):
    run_distributed(_body_z3_padding_tail, dist_world_size)


def _body_z3_expected_grad_dtype(ctx):
    """ZeRO-3 param with an fp32 target and expected_grad_dtype=fp32 receiving bf16 gradients:
    the gradient is cast to fp32 before bucketing, so the result matches the fp32 reduction of
    the (bf16-valued) gradients to fp32 precision, not bf16 precision."""
    ctx.init_runtime(CONFIG)
    specs = FP32_SPECS
    params = register_params(ctx, 3, specs, expected_grad_dtypes={s[0]: torch.float32 for s in specs})
    runtime.register_graph(GRAPH, list(params), 3)
    runtime.start_backward(True)
    refs = reduce_step(ctx, params, GRAPH, step=1, grad_dtypes={s[0]: torch.bfloat16 for s in specs})
    for i, p in params.items():
        assert p.target.dtype == torch.float32
        check_target(p, p.expected(refs[i]), "bf16 grads into fp32 targets")


def test_z3_expected_grad_dtype(dist_world_size):
    run_distributed(_body_z3_expected_grad_dtype, dist_world_size)


def _body_z1_step_local_targets(ctx):
    """ZeRO-1 gradient targets are step-local: registered without a target, bound to
    views of a fresh flat partition buffer before the update backward, and after the update
    backward released the buckets and the optimizer side called unbind_grad_targets, the runtime
    holds no target, no bucket, no pending task and no reference to the buffer's storage, so the
    partition is freed as soon as the optimizer side drops it (it is not held across steps)."""
    ctx.init_runtime(CONFIG)
    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    specs = FP32_SPECS
    offsets, pn = z12_layout(specs, world)
    ids = [s[0] for s in specs]
    shapes = {s[0]: s[1] for s in specs}
    for ds_id, shape, dtype in specs:
        runtime.register_z12_param(ds_id, shape, full_param(ds_id, shape, dtype, dev), offsets[ds_id], pn)
    for i in ids:
        assert not runtime.holds_grad_target(i), f"ds_id {i} has a target before any bind"
    runtime.register_graph(GRAPH, ids, 1)

    def local_reduce(step):
        grads = {i: rank_grad(i, shapes[i], rank, step, torch.float32, dev) for i in ids}
        refs = {i: averaged_full_grad(g) for i, g in grads.items()}
        outs = [ops.reduce_grad(grads[i], GRAPH, i) for i in ids]
        ops.end_backward(outs, GRAPH, True)
        return refs

    for window, (s1, s2) in enumerate([(1, 2), (3, 4)]):
        # Non-update micro-step with no target bound (targets are rebound to empty there).
        runtime.start_backward(False)
        r1 = local_reduce(s1)

        # Update step: a fresh flat partition buffer, per-parameter views bound as targets.
        flat = torch.full((pn,), float("nan"), device=dev)
        part_lo = rank * pn
        views = {}
        for i in ids:
            lo, hi = z12_overlap(offsets[i], numel_of(shapes[i]), pn, rank)
            start = offsets[i] + lo - part_lo if hi > lo else 0
            views[i] = flat[start : start + (hi - lo)]
            runtime.bind_grad_target(i, views[i])  # zeroes the view
            if hi > lo:
                assert runtime.holds_grad_target(i)
        runtime.start_backward(True)
        r2 = local_reduce(s2)
        for i in ids:
            lo, hi = z12_overlap(offsets[i], numel_of(shapes[i]), pn, rank)
            want = (r1[i] + r2[i])[lo:hi]
            torch.testing.assert_close(views[i].cpu(), want.cpu(), msg=lambda m: f"window {window} ds_id {i}: {m}")

        # The optimizer built its partition; release the targets.
        runtime.unbind_grad_targets()
        for i in ids:
            assert not runtime.holds_grad_target(i), f"ds_id {i}: target still held after unbind_grad_targets"
        assert runtime.reduce_bucket_numel() == 0
        assert runtime.pending_reduce_tasks() == 0
        weak = StorageWeakRef(flat.untyped_storage())
        del flat, views
        gc.collect()
        assert weak.expired(), (
            f"window {window}: the runtime still references the ZeRO-1 gradient partition after "
            "unbind_grad_targets"
        )


def test_z1_step_local_grad_targets(dist_world_size):
    run_distributed(_body_z1_step_local_targets, dist_world_size)


def _body_reduce_counts(ctx, stage):
    """reduce_counts() counts, per parameter, the gradients reduce_grad accepted in the current
    accumulation window: one per backward here (ZeRO-1 included, which reduces only at the
    update step), back to zero when the backward after an update step opens a new window."""
    ctx.init_runtime(CONFIG)
    params = register_params(ctx, stage, FP32_SPECS)
    runtime.register_graph(GRAPH, list(params), stage)
    ids = sorted(params)
    first = ids[:2]

    runtime.start_backward(False)
    reduce_step(ctx, params, GRAPH, step=1)
    assert runtime.reduce_counts() == {i: 1 for i in ids}, "after one backward"
    runtime.start_backward(True)
    reduce_step(ctx, params, GRAPH, step=2)
    assert runtime.reduce_counts() == {i: 2 for i in ids}, "after two backwards of one window"

    runtime.start_backward(False)  # the previous backward was an update step: a new window
    assert runtime.reduce_counts() == {i: 0 for i in ids}, "a new window must start from zero"
    reduce_step(ctx, params, GRAPH, step=3, ids=first)
    assert runtime.reduce_counts() == {i: int(i in first) for i in ids}, "after one backward of the new window"


@pytest.mark.world_size(2)
@pytest.mark.parametrize("stage", STAGES)
def test_reduce_counts_per_window(stage):
    require_world_size(2)
    run_distributed(_body_reduce_counts, 2, args=(stage,))
