"""All-gather side of the ``torch.ops.dc`` runtime, on 2 and 3 ranks against an eager reference.

``allgather_param`` / ``wait_allgather`` for numels that do not divide by the world size and in
every requested dtype (fused cast), ``prefetch_params_fused`` and the gather that reuses its
buffer, a gather shared between graphs, persistent parameters across an optimizer update, a
gather dtype that differs from the shard's, and ``release_param``'s countdown that frees the
gathered storage at the last user (and rejects user counts that disagree).
"""

from __future__ import annotations

import pytest
import torch

from deepcompile import runtime
from _harness.multiproc import run_distributed
from _harness.runtime_reference import (
    GRAPH, GRAPH2, CONFIG, FP32_SPECS, MIXED_SPECS, ppr_of, full_param, z3_shard, gather, assert_freed,
    assert_alive, same_storage, setup_z3, RE_USERS,
)

ops = torch.ops.dc


# ----------------------------------------------------------------------------------------------
# all-gather
# ----------------------------------------------------------------------------------------------


def _body_allgather_uneven(ctx):
    """allgather_param returns exactly the full parameter for numels not divisible by the world
    size, in the requested dtype (fused cast), or in the shard's dtype when none is requested (a
    bf16 shard gathers as bf16, never as fp32; test_op_schemas.py checks the same of the fake
    kernel, whose result DeepSpeed typed fp32 whatever the shard's dtype)."""
    fulls, shards = setup_z3(ctx, MIXED_SPECS)
    world = ctx.world_size
    for ds_id, shape, dtype in MIXED_SPECS:
        full = fulls[ds_id]
        assert shards[ds_id].numel() == ppr_of(full.numel(), world)
        for req in (None, torch.bfloat16, torch.float32):
            want_dtype = req if req is not None else dtype
            what = f"ds_id {ds_id} shape {shape} shard {dtype} requested {req}"
            out = ops.allgather_param(shards[ds_id], GRAPH, ds_id, req)
            waited = ops.wait_allgather(out, GRAPH, ds_id)
            assert waited.data_ptr() == out.data_ptr() and waited.shape == out.shape, f"{what}: wait_allgather must return its input"
            assert tuple(out.shape) == tuple(shape), f"{what}: shape {tuple(out.shape)}"
            assert out.dtype == want_dtype, f"{what}: dtype {out.dtype}"
            assert out.device == ctx.device
            assert torch.equal(out, full.to(want_dtype)), f"{what}: wrong values\n{out}\n{full}"
            assert runtime.is_gathered(ds_id), what
            buf = runtime.gathered_buffer(ds_id)
            assert buf is not None, what
            # The result is a view of the runtime's flat padded buffer (world * ppr elements).
            assert buf.numel() == world * ppr_of(full.numel(), world), f"{what}: buffer numel {buf.numel()}"
            assert same_storage(out, buf), f"{what}: result does not view the gathered buffer"
            ops.release_param(out, GRAPH, ds_id, 1)
            assert not runtime.is_gathered(ds_id) and runtime.gathered_buffer(ds_id) is None, what
            assert_freed(out, f"{what}: allgather_param's result after the final release")


def test_allgather_uneven_shapes_and_dtypes(dist_world_size):
    run_distributed(_body_allgather_uneven, dist_world_size)


def _body_prefetch(ctx):
    """prefetch_params_fused gathers in the requested dtypes; the later allgather_param of the
    same id and dtype returns the prefetched buffer (no second gather); a narrower dtype
    requested after a shard-dtype prefetch must convert only after the gather completed
    (DeepSpeed converted the buffer while the prefetch was still filling it, so the cast read
    stale bytes)."""
    fulls, shards = setup_z3(ctx, MIXED_SPECS)
    ids = [s[0] for s in MIXED_SPECS]
    world = ctx.world_size
    bf16 = torch.bfloat16

    # 1) prefetch in bf16, then gather in bf16: served from the prefetched buffer.
    ops.prefetch_params_fused(GRAPH, [shards[i] for i in ids], ids, [bf16] * len(ids))
    bufs = {}
    for i in ids:
        assert runtime.is_gathered(i), f"ds_id {i} not gathered after prefetch"
        buf = runtime.gathered_buffer(i)
        assert buf is not None and buf.dtype == bf16, f"ds_id {i}: prefetch ignored the requested dtype"
        assert buf.numel() == world * ppr_of(fulls[i].numel(), world)
        bufs[i] = buf
    # Prefetching already-gathered ids is a no-op: same buffers.
    ops.prefetch_params_fused(GRAPH, [shards[i] for i in ids], ids, [bf16] * len(ids))
    for i in ids:
        assert runtime.gathered_buffer(i).data_ptr() == bufs[i].data_ptr(), f"ds_id {i} re-gathered"
    for i in ids:
        out = gather(shards[i], GRAPH, i, bf16)
        assert out.dtype == bf16 and torch.equal(out, fulls[i].to(bf16)), f"ds_id {i}: wrong prefetched values"
        assert same_storage(out, bufs[i]), f"ds_id {i}: allgather_param did not return the prefetched buffer"
        ops.release_param(out, GRAPH, i, 1)
        assert_freed(out, f"ds_id {i}: prefetched buffer after the final release")
        assert not runtime.is_gathered(i)
    del bufs

    # 2) prefetch in the shard dtype (no dtypes, as the prefetch pass emits it), then request bf16
    # (and the shard dtype) right away, before wait_allgather.
    ops.prefetch_params_fused(GRAPH, [shards[i] for i in ids], ids)
    for i in ids:
        out = ops.allgather_param(shards[i], GRAPH, i, bf16)
        out = ops.wait_allgather(out, GRAPH, i)
        assert out.dtype == bf16 and torch.equal(out, fulls[i].to(bf16)), f"ds_id {i}: converted before the gather finished?"
        same = gather(shards[i], GRAPH, i)
        assert same.dtype == fulls[i].dtype and torch.equal(same, fulls[i])
        ops.release_param(out, GRAPH, i, 2)
        ops.release_param(same, GRAPH, i, 2)
        assert not runtime.is_gathered(i) and runtime.gathered_buffer(i) is None


def test_prefetch_then_allgather(dist_world_size):
    run_distributed(_body_prefetch, dist_world_size)


def _body_gather_state_is_shared_across_graphs(ctx):
    """A gather started by one graph (a prefetch) or outside any graph (``set_persistent``) is
    used by another graph: its gather and wait get that buffer, complete. DeepSpeed keeps the
    gather's completion event per executor (one per graph), so a graph other than the one that
    gathered did not wait for it; here the event lives with the parameter. Large parameters, so
    reading a gather still in flight would show."""
    specs = [(0, (2048, 1024), torch.float32), (1, (1024, 2049), torch.float32)]
    fulls, shards = setup_z3(ctx, specs)
    runtime.register_graph(GRAPH2, [0, 1], 3)
    for round_ in range(3):
        # Gathered by GRAPH's prefetch, waited on and read in GRAPH2.
        ops.prefetch_params_fused(GRAPH, [shards[0]], [0])
        out = gather(shards[0], GRAPH2, 0)
        assert torch.equal(out, fulls[0]), f"round {round_}: GRAPH2 read GRAPH's gather before it landed"
        assert same_storage(out, runtime.gathered_buffer(0)), f"round {round_}: GRAPH2 gathered a second copy"
        ops.release_param(out, GRAPH2, 0, 1)
        assert not runtime.is_gathered(0)
    # Gathered by set_persistent (outside any graph), read by both graphs.
    runtime.set_persistent(1)
    for graph in (GRAPH, GRAPH2):
        out = gather(shards[1], graph, 1)
        assert torch.equal(out, fulls[1]), f"graph {graph}: persistent gather read before it landed"
        ops.release_param(out, graph, 1, 1)
        assert runtime.is_gathered(1)


def test_gather_state_is_shared_across_graphs(dist_world_size):
    run_distributed(_body_gather_state_is_shared_across_graphs, dist_world_size)


def _body_persistent(ctx):
    """Persistent parameters stay gathered across releases; after an optimizer step changed the
    shards in place and ``invalidate_all_gathered``, a fused-cast gather returns the UPDATED
    values in the REQUESTED dtype (DeepSpeed returned the old fp32 buffer there), an fp32
    request is exact again (never an up-cast of a bf16 copy), and a param registered
    persistent=True can be gathered more than once (DeepSpeed's second gather of such a param
    failed)."""
    A, B = 11, 23  # A: set_persistent after registration; B: persistent=True at registration
    specs = [s for s in FP32_SPECS if s[0] in (A, B)]
    fulls, shards = setup_z3(ctx, specs, persistent={B})
    runtime.set_persistent(A)
    assert runtime.is_persistent(A) and runtime.is_persistent(B)
    bf16 = torch.bfloat16

    def episode(i, dtype, expected, what):
        out = gather(shards[i], GRAPH, i, dtype)
        want = dtype or torch.float32
        assert out.dtype == want, f"{what}: ds_id {i}: got dtype {out.dtype}, requested {want}"
        assert torch.equal(out, expected.to(want)), f"{what}: ds_id {i}: wrong values\n{out}\n{expected}"
        ops.release_param(out, GRAPH, i, 1)
        # Not freed: persistent.
        assert_alive(out, f"{what}: ds_id {i}: persistent param after release")
        assert runtime.is_gathered(i), f"{what}: ds_id {i}: persistent param no longer gathered after release"
        assert torch.equal(out, expected.to(want)), f"{what}: ds_id {i}: persistent buffer changed after release"

    for i in (A, B):
        episode(i, None, fulls[i], "first gather")
        episode(i, None, fulls[i], "second gather of a persistent param")

    # Simulated optimizer step: shards change in place, gathered copies become stale.
    for i in (A, B):
        shards[i].add_(1)
    runtime.invalidate_all_gathered()
    for i in (A, B):
        assert not runtime.is_gathered(i), f"ds_id {i}: still valid after invalidate_all_gathered"
    for i in (A, B):
        episode(i, bf16, fulls[i] + 1, "bf16 after update (updated values, requested dtype)")
        episode(i, None, fulls[i] + 1, "fp32 after a bf16 gather")

    # Another step; prefetch in the shard dtype then request bf16: the conversion of a buffer
    # that is already valid must wait for the prefetch to land, not read it half-filled.
    for i in (A, B):
        shards[i].add_(1)
    runtime.invalidate_all_gathered()
    ops.prefetch_params_fused(GRAPH, [shards[A], shards[B]], [A, B])
    for i in (A, B):
        episode(i, bf16, fulls[i] + 2, "bf16 after prefetch")


def test_persistent_params_after_update(dist_world_size):
    run_distributed(_body_persistent, dist_world_size)


def _body_gather_dtype_differs_from_shard(ctx):
    """An fp32 shard registered with gather dtype bf16 (how the engine registers a bf16 model's
    fp32 master shard): a gather without a dtype returns bf16, the bf16 rounding of the full fp32
    tensor; prefetches without dtypes and set_persistent gather in bf16 as well, so later uses get
    the gathered buffer itself with no conversion; an explicit fp32 request gets the parameter's
    (bf16-rounded) values, never the unrounded master; the shard stays the gather source across
    in-place updates. An invalid gather dtype fails on every rank, naming the ds id."""
    ctx.init_runtime(CONFIG)
    A, B = 11, 23  # A: fp32 shard gathered as bf16; B: default gather dtype (the shard's, fp32)
    bf16, fp32 = torch.bfloat16, torch.float32
    specs = [s for s in FP32_SPECS if s[0] in (A, B)]
    fulls = {i: full_param(i, shape, fp32, ctx.device) for i, shape, _ in specs}
    shards = {i: z3_shard(fulls[i], ctx.world_size, ctx.rank) for i in fulls}
    assert not torch.equal(fulls[A].to(bf16).float(), fulls[A]), "test data must not be bf16-exact"
    runtime.register_z3_params(
        [A, B], [s[1] for s in specs], [shards[A], shards[B]], [None, None], gather_dtypes=[bf16, None]
    )
    runtime.register_graph(GRAPH, [A, B], 3)
    assert runtime.gather_dtype(A) == bf16 and runtime.gather_dtype(B) == fp32
    reg = runtime.registered_shard(A)
    assert reg.dtype == fp32 and reg.data_ptr() == shards[A].data_ptr(), "the fp32 shard must be registered as is"

    # 1) No dtype requested: the gather dtype, values rounded once from fp32.
    for i, want in ((A, bf16), (B, fp32)):
        out = gather(shards[i], GRAPH, i)
        assert out.dtype == want, f"ds_id {i}: gathered as {out.dtype}, gather dtype is {want}"
        assert torch.equal(out, fulls[i].to(want)), f"ds_id {i}: wrong values"
        assert runtime.gathered_buffer(i).dtype == want
        ops.release_param(out, GRAPH, i, 1)
        assert_freed(out, f"ds_id {i}: after the final release")
    meta = ops.allgather_param(torch.empty(specs[0][1], device="meta"), GRAPH, A)
    assert meta.dtype == bf16 and tuple(meta.shape) == specs[0][1], "meta kernel must use the gather dtype"

    # 2) An explicit fp32 request, fresh: the parameter's value is bf16(master), widened.
    out = gather(shards[A], GRAPH, A, fp32)
    assert out.dtype == fp32 and torch.equal(out, fulls[A].to(bf16).float()), "fp32 request must see bf16 rounding"
    ops.release_param(out, GRAPH, A, 1)

    # 3) A prefetch without dtypes (as the prefetch pass emits for uncast uses) lands in bf16; the
    # later gather without a dtype returns that very buffer; an fp32 request converts from it.
    ops.prefetch_params_fused(GRAPH, [shards[A], shards[B]], [A, B])
    buf = runtime.gathered_buffer(A)
    assert buf is not None and buf.dtype == bf16, "prefetch without dtypes must gather in the gather dtype"
    assert runtime.gathered_buffer(B).dtype == fp32
    out = gather(shards[A], GRAPH, A)
    assert same_storage(out, buf) and torch.equal(out, fulls[A].to(bf16)), "a second copy was made"
    wide = gather(shards[A], GRAPH, A, fp32)
    assert wide.dtype == fp32 and torch.equal(wide, fulls[A].to(bf16).float())
    ops.release_param(out, GRAPH, A, 2)
    ops.release_param(wide, GRAPH, A, 2)
    out_b = gather(shards[B], GRAPH, B)
    ops.release_param(out_b, GRAPH, B, 1)
    assert not runtime.is_gathered(A) and not runtime.is_gathered(B)

    # 4) set_persistent gathers right away, in bf16; uses get that buffer without conversion.
    runtime.set_persistent(A)
    buf = runtime.gathered_buffer(A)
    assert buf is not None and buf.dtype == bf16, f"set_persistent gathered in {None if buf is None else buf.dtype}"
    out = gather(shards[A], GRAPH, A)
    assert same_storage(out, buf) and torch.equal(out, fulls[A].to(bf16))
    ops.release_param(out, GRAPH, A, 1)
    assert_alive(out, "persistent buffer after release")

    # 5) The shard is the gather source: an in-place update (what the optimizer does to the
    # master) shows after invalidation, rounded to bf16, in the same persistent buffer.
    shards[A].add_(1.0 / 3.0)
    runtime.invalidate_all_gathered()
    out = gather(shards[A], GRAPH, A)
    assert out.dtype == bf16 and torch.equal(out, (fulls[A] + 1.0 / 3.0).to(bf16)), "stale or unrounded values"
    assert same_storage(out, buf), "the persistent buffer was not reused"
    ops.release_param(out, GRAPH, A, 1)

    # 6) Invalid gather dtypes: every rank raises (a collective verdict), naming the ds id, and
    # nothing of the batch is registered.
    C = 5
    shard_c = z3_shard(full_param(C, (1,), fp32, ctx.device), ctx.world_size, ctx.rank)
    with pytest.raises(RuntimeError, match=r"gather dtype of ds id 5 is Int.*floating-point"):
        runtime.register_z3_params([C], [(1,)], [shard_c], [None], gather_dtypes=[torch.int32])
    with pytest.raises(RuntimeError, match=r"shard of ds id 5 is stored as Long and cannot be gathered as BFloat16"):
        runtime.register_z3_params([C], [(1,)], [shard_c.long()], [None], gather_dtypes=[bf16])
    with pytest.raises(TypeError, match=r"gather dtype of ds id 5"):
        runtime.register_z3_params([C], [(1,)], [shard_c], [None], gather_dtypes=["bfloat16"])
    with pytest.raises(RuntimeError, match=r"unknown ds id 5"):
        runtime.is_gathered(C)
    runtime.register_z3_param(C, (1,), shard_c, gather_dtype=bf16)
    assert runtime.gather_dtype(C) == bf16


def test_gather_dtype_differs_from_shard(dist_world_size):
    run_distributed(_body_gather_dtype_differs_from_shard, dist_world_size)


# ----------------------------------------------------------------------------------------------
# release
# ----------------------------------------------------------------------------------------------


def _body_release_counting(ctx):
    """release_param counts down from n_users; only the last release frees, and it frees the
    padded storage itself, so neither the graph's view, another view, nor the registry's buffer
    keeps it alive: the memory returns at the last release, not whenever the last Python
    reference to a view happens to die. A second gather episode works afterwards."""
    fulls, shards = setup_z3(ctx, FP32_SPECS)
    A = 11
    full, shard = fulls[A], shards[A]

    out = gather(shard, GRAPH, A)
    other_view = out.reshape(-1)[2:5]
    buf = runtime.gathered_buffer(A)
    consumer = out * 2  # what the graph passes to release_param: the consumer's output

    r1 = ops.release_param(consumer, GRAPH, A, 2)
    assert r1.data_ptr() == consumer.data_ptr() and torch.equal(r1, consumer), "release_param must return its input"
    assert_alive(out, "after the first of two releases")
    assert runtime.is_gathered(A) and runtime.gathered_buffer(A) is not None
    assert torch.equal(out, full), "gathered values changed after a non-final release"

    ops.release_param(consumer, GRAPH, A, 2)
    assert_freed(out, "allgather_param's result after the final release")
    assert_freed(other_view, "another view of the gathered parameter after the final release")
    assert_freed(buf, "the registry's padded buffer after the final release")
    assert not runtime.is_gathered(A) and runtime.gathered_buffer(A) is None
    assert torch.equal(consumer, full * 2), "release_param changed its input"
    del out, other_view, buf

    # Second episode, three users.
    out = gather(shard, GRAPH, A)
    assert torch.equal(out, full)
    for k in range(3):
        ops.release_param(out.clone(), GRAPH, A, 3)
        if k < 2:
            assert_alive(out, f"after release {k + 1} of 3")
            assert runtime.is_gathered(A), f"not gathered after release {k + 1} of 3"
    assert_freed(out, "after release 3 of 3")
    assert not runtime.is_gathered(A)

    # A fused-cast gather is freed the same way.
    out = gather(shard, GRAPH, A, torch.bfloat16)
    assert torch.equal(out, full.to(torch.bfloat16))
    ops.release_param(out, GRAPH, A, 1)
    assert_freed(out, "bf16 gather after its final release")
    assert runtime.gathered_buffer(A) is None


def test_release_counts_users_and_frees_storage(dist_world_size):
    run_distributed(_body_release_counting, dist_world_size)


def _body_error_release_n_users(ctx):
    """release_param with n_users that disagree within one gather episode, or n_users < 1,
    raises instead of silently corrupting the countdown."""
    fulls, shards = setup_z3(ctx, FP32_SPECS)
    A, B = 11, 23
    out = gather(shards[A], GRAPH, A)
    ops.release_param(out, GRAPH, A, 2)
    with pytest.raises(RuntimeError, match=RE_USERS):
        ops.release_param(out, GRAPH, A, 3)
    out_b = gather(shards[B], GRAPH, B)
    with pytest.raises(RuntimeError, match=RE_USERS):
        ops.release_param(out_b, GRAPH, B, 0)


def test_error_release_inconsistent_n_users(dist_world_size):
    run_distributed(_body_error_release_n_users, dist_world_size)
