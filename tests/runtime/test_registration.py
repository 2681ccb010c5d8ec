"""Registration of parameters and graphs, and ops called with ids the runtime does not know.

An unknown graph id, an unknown ds id, a registered id outside the graph, a ZeRO-3 op on a
ZeRO-1/2 graph and a shard of the wrong size must each raise a Python ``RuntimeError`` (on every
rank, where the check is collective), never abort the process, and leave the runtime usable.
"""

from __future__ import annotations

import pytest
import torch

from deepcompile import runtime
from _harness.multiproc import run_distributed
from _harness.runtime_reference import (
    GRAPH, GRAPH2, CONFIG, FP32_SPECS, ppr_of, full_param, z3_shard, z12_layout, ErrorChecks, gather,
    UNKNOWN_GRAPH, UNKNOWN_ID, re_unknown_graph, re_unknown_id, re_not_in_graph, re_wrong_stage,
)

ops = torch.ops.dc


def _body_errors_unknown_ids(ctx):
    """Unknown graph id, unknown ds id, and a registered id that is not in the graph: each op
    raises a RuntimeError (DeepSpeed asserted, segfaulted or threw std::out_of_range). The
    runtime stays usable afterwards."""
    A, B = 11, 23
    specs = [s for s in FP32_SPECS if s[0] in (A, B)]
    ctx.init_runtime(CONFIG)
    fulls = {i: full_param(i, shape, dtype, ctx.device) for i, shape, dtype in specs}
    shards = {i: z3_shard(fulls[i], ctx.world_size, ctx.rank) for i in fulls}
    runtime.register_z3_params([A, B], [s[1] for s in specs], [shards[A], shards[B]], [None, None])
    runtime.register_graph(GRAPH, [A], 3)  # B is registered but not in GRAPH
    x = shards[A]
    g = torch.ones(5, 3, device=ctx.device)
    chk = ErrorChecks()

    gid = UNKNOWN_GRAPH
    unknown_graph = re_unknown_graph(gid)
    chk.expect("unknown graph: allgather_param", unknown_graph, ops.allgather_param, x, gid, A)
    chk.expect("unknown graph: prefetch_params_fused", unknown_graph, ops.prefetch_params_fused, gid, [x], [A])
    chk.expect("unknown graph: wait_allgather", unknown_graph, ops.wait_allgather, x, gid, A)
    chk.expect("unknown graph: release_param", unknown_graph, ops.release_param, x, gid, A, 1)
    chk.expect("unknown graph: reduce_grad", unknown_graph, ops.reduce_grad, g, gid, A)
    chk.expect("unknown graph: end_backward", unknown_graph, ops.end_backward, [g], gid, False)

    # An op checks the id against its graph first: an id nobody registered is not in the graph either.
    for ds_id, pattern, label in ((UNKNOWN_ID, re_not_in_graph(UNKNOWN_ID, GRAPH), "unknown ds id"),
                                  (B, re_not_in_graph(B, GRAPH), "id not in graph")):
        chk.expect(f"{label}: allgather_param", pattern, ops.allgather_param, x, GRAPH, ds_id)
        chk.expect(f"{label}: prefetch_params_fused", pattern, ops.prefetch_params_fused, GRAPH, [x], [ds_id])
        chk.expect(f"{label}: wait_allgather", pattern, ops.wait_allgather, x, GRAPH, ds_id)
        chk.expect(f"{label}: release_param", pattern, ops.release_param, x, GRAPH, ds_id, 1)
        chk.expect(f"{label}: reduce_grad", pattern, ops.reduce_grad, g, GRAPH, ds_id)

    chk.expect("unknown ds id: bind_grad_target", re_unknown_id(UNKNOWN_ID), runtime.bind_grad_target, UNKNOWN_ID, torch.zeros(3, device=ctx.device))
    chk.expect("unknown ds id: set_persistent", re_unknown_id(UNKNOWN_ID), runtime.set_persistent, UNKNOWN_ID)
    chk.assert_none()

    # Still usable: nothing half-done was left behind by the rejected calls.
    assert runtime.pending_reduce_tasks() == 0
    out = gather(x, GRAPH, A)
    assert torch.equal(out, fulls[A])
    ops.release_param(out, GRAPH, A, 1)
    assert not runtime.is_gathered(A)


def test_errors_unknown_graph_and_ids(dist_world_size):
    run_distributed(_body_errors_unknown_ids, dist_world_size)


def _body_error_bad_shard(ctx, variant):
    """A shard whose numel is not ppr on ANY rank makes EVERY rank raise at registration
    (DeepSpeed's size check compared a value with itself, so a wrong shard went through and the
    ranks later passed different element counts to the same collective). The failed batch
    registers nothing, so the same ids register fine afterwards and gather correctly."""
    world, rank = ctx.world_size, ctx.rank
    ctx.init_runtime(CONFIG)
    A, B = 11, 23
    specs = [s for s in FP32_SPECS if s[0] in (A, B)]
    fulls = {i: full_param(i, shape, dtype, ctx.device) for i, shape, dtype in specs}
    shards = {i: z3_shard(fulls[i], world, rank) for i in fulls}
    pB = ppr_of(fulls[B].numel(), world)
    bad = {
        "first_rank_long": {0: pB + 1},
        "last_rank_short": {world - 1: pB - 1},
        "all_ranks_long": {r: pB + 2 for r in range(world)},
    }[variant]
    shard_b = torch.zeros(bad[rank], device=ctx.device) if rank in bad else shards[B]
    with pytest.raises(RuntimeError, match=r"(?i)shard"):
        runtime.register_z3_params([A, B], [s[1] for s in specs], [shards[A], shard_b], [None, None])

    runtime.register_z3_params([A, B], [s[1] for s in specs], [shards[A], shards[B]], [None, None])
    runtime.register_graph(GRAPH, [A, B], 3)
    for i in (A, B):
        out = gather(shards[i], GRAPH, i)
        assert torch.equal(out, fulls[i])
        ops.release_param(out, GRAPH, i, 1)


@pytest.mark.parametrize("variant", ["first_rank_long", "last_rank_short", "all_ranks_long"])
def test_error_wrong_shard_size_raises_on_every_rank(dist_world_size, variant):
    run_distributed(_body_error_bad_shard, dist_world_size, args=(variant,))


def _body_error_wrong_stage(ctx):
    """ZeRO-3-only ops on a graph registered for stage 1 or 2 raise (not a bad cast / abort)."""
    ctx.init_runtime(CONFIG)
    offsets, pn = z12_layout(FP32_SPECS, ctx.world_size)
    P = 11
    shape = (5, 3)
    runtime.register_z12_param(P, shape, full_param(P, shape, torch.float32, ctx.device), offsets[P], pn)
    runtime.register_graph(GRAPH, [P], 1)
    runtime.register_graph(GRAPH2, [P], 2)
    x = torch.zeros(shape, device=ctx.device)
    chk = ErrorChecks()
    for gid, stage in ((GRAPH, 1), (GRAPH2, 2)):
        wrong_stage = re_wrong_stage(gid, stage)
        chk.expect(f"stage {stage}: allgather_param", wrong_stage, ops.allgather_param, x, gid, P)
        chk.expect(f"stage {stage}: prefetch_params_fused", wrong_stage, ops.prefetch_params_fused, gid, [x], [P])
        chk.expect(f"stage {stage}: wait_allgather", wrong_stage, ops.wait_allgather, x, gid, P)
        chk.expect(f"stage {stage}: release_param", wrong_stage, ops.release_param, x, gid, P, 1)
    chk.assert_none()


def test_error_executor_of_wrong_stage(dist_world_size):
    run_distributed(_body_error_wrong_stage, dist_world_size)


def _body_wrong_stage_layout(ctx):
    """A parameter registered again for the other stage after its graph was registered: the
    graph's ops and the ZeRO-3 control and introspection calls raise an error that names the ds
    id and both stages (the runtime used to read the other stage's fields: a ZeRO-1/2 parameter
    "gathered" with a 0-element shard). Calls over all parameters skip ZeRO-1/2 ones, and the
    runtime stays usable."""
    import re

    ctx.init_runtime(CONFIG)
    world, dev = ctx.world_size, ctx.device
    A, B = 11, 23
    shape = (5, 3)
    full_a = full_param(A, shape, torch.float32, dev)
    shard_a = z3_shard(full_a, world, ctx.rank)
    pn = ppr_of(full_a.numel(), world)
    runtime.register_z3_params([A], [shape], [shard_a], [None])
    runtime.register_graph(GRAPH, [A], 3)
    runtime.register_z12_param(A, shape, full_a, 0, pn)  # A is now a ZeRO-1/2 parameter

    not_z3 = re.escape(f"ds id {A} is registered for ZeRO-1/2, not ZeRO-3")
    x = torch.zeros(shape, device=dev)
    chk = ErrorChecks()
    chk.expect("allgather_param", not_z3, ops.allgather_param, x, GRAPH, A)
    chk.expect("allgather_param (fake kernel)", not_z3, ops.allgather_param, torch.empty(shape, device="meta"), GRAPH, A)
    chk.expect("prefetch_params_fused", not_z3, ops.prefetch_params_fused, GRAPH, [x], [A])
    chk.expect("wait_allgather", not_z3, ops.wait_allgather, x, GRAPH, A)
    chk.expect("release_param", not_z3, ops.release_param, x, GRAPH, A, 1)
    runtime.start_backward(True)  # an update step: the ZeRO-3 end of backward marks persistent copies stale
    chk.expect("end_backward", not_z3, ops.end_backward, [x], GRAPH, True)
    for name in ("set_persistent", "invalidate_gathered_param", "is_gathered", "is_persistent", "gathered_buffer", "gather_dtype"):
        chk.expect(name, f"{name}: {not_z3}", getattr(runtime, name), A)
    chk.expect("register_graph", not_z3, runtime.register_graph, GRAPH2, [A], 3)

    # The reverse: a ZeRO-1 graph's parameter registered again for ZeRO-3.
    full_b = full_param(B, shape, torch.float32, dev)
    runtime.register_z12_param(B, shape, full_b, 0, pn)
    runtime.register_graph(GRAPH2, [B], 1)
    runtime.register_z3_params([B], [shape], [z3_shard(full_b, world, ctx.rank)], [None])
    chk.expect("reduce_grad", re.escape(f"ds id {B} is registered for ZeRO-3, not ZeRO-1/2"), ops.reduce_grad, torch.ones(shape, device=dev), GRAPH2, B)
    chk.assert_none()
    assert runtime.pending_reduce_tasks() == 0 and runtime.reduce_counts()[B] == 0

    # What both stages have still works, and the calls over all parameters skip ZeRO-1/2 ones.
    assert runtime.registered_shard(A).data_ptr() == full_a.data_ptr()  # ZeRO-1/2: the replicated parameter
    runtime.clear_all_gathered_params()
    runtime.invalidate_all_gathered()
    # Registering the graphs again with the current layouts makes them usable.
    runtime.register_graph(GRAPH2, [B], 3)
    out = gather(z3_shard(full_b, world, ctx.rank), GRAPH2, B)
    assert torch.equal(out, full_b)
    ops.release_param(out, GRAPH2, B, 1)
    assert not runtime.is_gathered(B)


def test_error_parameter_registered_again_for_other_stage(dist_world_size):
    run_distributed(_body_wrong_stage_layout, dist_world_size)


def _body_register_again_while_reduction_pending(ctx):
    """Registering an id again while a reduction of its gradient is queued (handed over, not yet
    flushed by end_backward) is refused on every rank, for either stage: the queued gradient
    would be flushed into the new registration's target, of another size or stage. After the
    backward ends the old target holds the gradient and the id registers again."""
    ctx.init_runtime(CONFIG)
    world, dev = ctx.world_size, ctx.device
    B = 23
    shape = (7,)
    full_b = full_param(B, shape, torch.float32, dev)
    shard_b = z3_shard(full_b, world, ctx.rank)
    target_b = torch.zeros_like(shard_b)
    runtime.register_z3_params([B], [shape], [shard_b], [target_b])
    runtime.register_graph(GRAPH, [B], 3)
    runtime.start_backward(True)
    dep = ops.reduce_grad(torch.ones(shape, device=dev), GRAPH, B)
    assert runtime.pending_reduce_tasks() == 1  # the bucket is far from full: queued, not flushed
    pending = "ds id 23 has a gradient reduction queued"
    with pytest.raises(RuntimeError, match=pending):
        runtime.register_z3_params([B], [shape], [z3_shard(full_b, world, ctx.rank)], [None])
    with pytest.raises(RuntimeError, match=pending):
        runtime.register_z12_param(B, shape, full_b, 0, ppr_of(full_b.numel(), world))
    ops.end_backward([dep], GRAPH, False)
    # Every rank's gradient of ones, averaged: this rank's piece of a vector of ones (padding 0).
    expected = z3_shard(torch.ones(shape, device=dev), world, ctx.rank)
    torch.testing.assert_close(target_b, expected)
    runtime.register_z3_params([B], [shape], [z3_shard(full_b, world, ctx.rank)], [None])


def test_error_register_again_while_reduction_pending(dist_world_size):
    run_distributed(_body_register_again_while_reduction_pending, dist_world_size)
