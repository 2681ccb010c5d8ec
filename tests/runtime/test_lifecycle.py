"""Lifecycle of the runtime and of the memory it frees: ``init`` / ``cleanup``, calls before
``init``, and ``free_tensors``.

Every call before ``init`` raises a ``RuntimeError`` that says so; ``cleanup`` is idempotent and
drops every reference the runtime held (shards, gradient targets, persistent buffers, buckets);
``free_tensors`` frees activations by byte size.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from deepcompile import runtime
from deepcompile.runtime import RuntimeConfig
from _harness.multiproc import run_distributed
from _harness.runtime_reference import (
    GRAPH, CONFIG, full_param, z3_shard, ErrorChecks, gather, assert_freed, assert_alive, re_unknown_graph,
    RE_NOT_INIT,
)

ops = torch.ops.dc


def _body_errors_before_init(ctx):
    """Every op and control call before runtime.init raises a RuntimeError that says so;
    cleanup() and is_initialized() are the exceptions (cleanup is a no-op, twice)."""
    runtime.cleanup()
    runtime.cleanup()
    assert not runtime.is_initialized()
    dev = ctx.device
    x = torch.zeros(4, device=dev)
    chk = ErrorChecks()
    calls = [
        ("allgather_param", ops.allgather_param, (x, GRAPH, 1)),
        ("prefetch_params_fused", ops.prefetch_params_fused, (GRAPH, [x], [1])),
        ("wait_allgather", ops.wait_allgather, (x, GRAPH, 1)),
        ("release_param", ops.release_param, (x, GRAPH, 1, 1)),
        ("reduce_grad", ops.reduce_grad, (x, GRAPH, 1)),
        ("end_backward", ops.end_backward, ([x], GRAPH, True)),
        ("free_tensors", ops.free_tensors, ([torch.zeros(1 << 20, device=dev)],)),
        ("register_z3_params", runtime.register_z3_params, ([1], [(4,)], [x], [None])),
        ("register_z12_param", runtime.register_z12_param, (1, (4,), x, 0, 2)),
        ("bind_grad_target", runtime.bind_grad_target, (1, x)),
        ("unbind_grad_targets", runtime.unbind_grad_targets, ()),
        ("register_graph", runtime.register_graph, (GRAPH, [1], 3)),
        ("set_persistent", runtime.set_persistent, (1,)),
        ("start_backward", runtime.start_backward, (True,)),
        ("reset", runtime.reset, ()),
        ("enable_profiling", runtime.enable_profiling, (True,)),
        ("invalidate_gathered_param", runtime.invalidate_gathered_param, (1,)),
        ("clear_all_gathered_params", runtime.clear_all_gathered_params, ()),
        ("invalidate_all_gathered", runtime.invalidate_all_gathered, ()),
        ("is_gathered", runtime.is_gathered, (1,)),
        ("is_persistent", runtime.is_persistent, (1,)),
        ("gathered_buffer", runtime.gathered_buffer, (1,)),
        ("pending_reduce_tasks", runtime.pending_reduce_tasks, ()),
        ("reduce_counts", runtime.reduce_counts, ()),
        ("reduce_bucket_numel", runtime.reduce_bucket_numel, ()),
        ("holds_grad_target", runtime.holds_grad_target, (1,)),
        ("world_size", runtime.world_size, ()),
        ("rank", runtime.rank, ()),
    ]
    for name, fn, args in calls:
        chk.expect(f"{name} before init", RE_NOT_INIT, fn, *args)
    chk.assert_none()
    assert not runtime.is_initialized()


def test_errors_before_init(dist_world_size):
    run_distributed(_body_errors_before_init, dist_world_size)


def _body_init_cleanup(ctx):
    """cleanup twice is safe; init twice replaces the runtime; a new init after cleanup works and
    knows nothing of the old graphs (DeepSpeed's teardown leaked part of its state and freed other
    parts twice)."""
    A = 11
    full = full_param(A, (5, 3), torch.float32, ctx.device)
    shard = z3_shard(full, ctx.world_size, ctx.rank)

    def register_and_gather():
        runtime.register_z3_params([A], [(5, 3)], [shard], [None])
        runtime.register_graph(GRAPH, [A], 3)
        out = gather(shard, GRAPH, A)
        assert torch.equal(out, full)
        ops.release_param(out, GRAPH, A, 1)

    runtime.cleanup()
    runtime.cleanup()
    assert not runtime.is_initialized()

    ctx.init_runtime(CONFIG)
    assert runtime.is_initialized()
    assert runtime.world_size() == ctx.world_size and runtime.rank() == ctx.rank
    register_and_gather()

    ctx.init_runtime(CONFIG)  # init again without cleanup: starts from scratch
    assert runtime.is_initialized()
    with pytest.raises(RuntimeError, match=re_unknown_graph(GRAPH)):
        ops.allgather_param(shard, GRAPH, A)
    register_and_gather()

    runtime.cleanup()
    runtime.cleanup()
    assert not runtime.is_initialized()
    ctx.init_runtime(CONFIG)
    with pytest.raises(RuntimeError, match=re_unknown_graph(GRAPH)):
        ops.allgather_param(shard, GRAPH, A)
    register_and_gather()

    # cleanup drops everything the runtime held (DeepSpeed's kept its registry and buckets alive):
    # the shard, the gradient target, a persistent gathered buffer and the reduce buckets.
    runtime.cleanup()
    ctx.init_runtime(CONFIG)
    B = 23
    full_b = full_param(B, (7,), torch.float32, ctx.device)
    shard_b = z3_shard(full_b, ctx.world_size, ctx.rank)
    target_b = torch.zeros_like(shard_b)
    runtime.register_z3_params([B], [(7,)], [shard_b], [target_b], persistent=[True])
    runtime.register_graph(GRAPH, [B], 3)
    out = gather(shard_b, GRAPH, B)
    ops.release_param(out, GRAPH, B, 1)  # persistent: stays gathered
    runtime.start_backward(True)
    dep = ops.reduce_grad(torch.ones(7, device=ctx.device), GRAPH, B)
    ops.end_backward([dep], GRAPH, False)  # buckets kept
    weak = {
        "shard": StorageWeakRef(shard_b.untyped_storage()),
        "gradient target": StorageWeakRef(target_b.untyped_storage()),
        "persistent gathered buffer": StorageWeakRef(out.untyped_storage()),
    }
    del shard_b, target_b, out, dep
    runtime.cleanup()
    gc.collect()
    alive = [name for name, w in weak.items() if not w.expired()]
    assert not alive, f"still referenced after cleanup: {alive}"


def test_init_cleanup_idempotent(dist_world_size):
    run_distributed(_body_init_cleanup, dist_world_size)


def _body_free_tensors(ctx):
    """free_tensors frees tensors whose BYTE size exceeds free_activation_threshold (DeepSpeed
    compared the element count with that byte threshold) and keeps the others intact."""
    threshold = 64
    ctx.init_runtime(RuntimeConfig(reduce_bucket_size=1024, free_activation_threshold=threshold))
    dev = ctx.device
    freed = {
        "fp32 x20 = 80 B (numel 20 < 64)": torch.randn(20, device=dev),
        "bf16 x40 = 80 B": torch.randn(40, device=dev).to(torch.bfloat16),
        "int8 x100 = 100 B": torch.ones(100, dtype=torch.int8, device=dev),
        "fp32 4x8 = 128 B": torch.randn(4, 8, device=dev),
    }
    kept = {
        "fp32 x16 = 64 B (not above)": torch.randn(16, device=dev),
        "fp32 x8 = 32 B": torch.randn(8, device=dev),
        "int8 x64 = 64 B": torch.ones(64, dtype=torch.int8, device=dev),
    }
    # A 16-byte tensor inside a 400-byte storage (e.g. a slice of a larger activation): its own
    # byte size is under the threshold, so neither it nor the storage it shares is freed.
    base = torch.randn(100, device=dev)
    kept["fp32 x4 view of a 400 B storage"] = base[10:14]
    # Above the threshold but a part of a larger storage (a chunk of a fused buffer): freeing it
    # would free the rest of that buffer too, still in use (before: freed).
    fused = torch.randn(200, device=dev)
    kept["fp32 x100 half of an 800 B storage"] = fused[100:]
    kept["fp32 x100 first half of an 800 B storage"] = fused[:100]
    kept_values = {k: v.clone() for k, v in kept.items()}
    result = ops.free_tensors(list(freed.values()) + list(kept.values()))
    assert result is None
    for name, t in freed.items():
        assert_freed(t, name)
    for name, t in kept.items():
        assert_alive(t, name)
        assert torch.equal(t, kept_values[name]), f"{name}: values changed"


def test_free_tensors_threshold_in_bytes(dist_world_size):
    run_distributed(_body_free_tensors, dist_world_size)
