"""GPU checks of the runtime's stream and allocator bookkeeping and its boundary checks (issue 42
item 3), one rank (NCCL), one process per run. CPU runs skip them (``DC_TEST_DEVICE=cuda``).

* recordStream at each cross-lane use. The caching allocator remembers the stream a block was
  allocated on and hands it out again as soon as it is freed there, with no regard for other
  streams still using it, unless the block was recorded on them. The shard a gather reads on the
  all-gather lane and the gradient target a flush writes on the reduce lane were allocated on the
  compute stream: freed while the lane still uses them (offload frees a shard's device storage;
  a caller drops a target), their blocks went straight back to compute-stream allocations, which
  the lane then read or overwrote. Each test holds its lane busy (``torch.cuda._sleep``), queues
  the runtime's work behind that, frees the tensor and allocates one of the same size on the
  compute stream: it must not get the block the lane has yet to use.
* The NCCL communicator prints every collective under ``DC_DEBUG_COLLECTIVES=1``, in the gloo
  communicator's format.
* A pageable host shard is warned about at ``set_host_shard`` (every gather's copy from it is
  synchronous); a pinned one (``pinned_host_buffer``) is not.
* A tensor on another GPU than the runtime's is refused, naming both (two GPUs).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings

import pytest
import torch

from _harness.multiproc import run_distributed

pytestmark = pytest.mark.world_size(1)

GRAPH = 7
SLEEP_CYCLES = int(2e9)  # about a second of a busy lane on current GPUs


@contextlib.contextmanager
def _captured_stderr(into: list):
    """What the process writes to file descriptor 2 (C++ warnings and traces), plus Python
    warnings, appended to ``into`` as one string."""
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            into.append(tmp.read().decode(errors="replace") + "\n".join(str(w.message) for w in caught))


def _init(ctx, bucket: int = 1 << 20):
    from deepcompile.runtime import RuntimeConfig

    ctx.init_runtime(RuntimeConfig(reduce_bucket_size=bucket))


def _gather_source_body(ctx):
    from deepcompile import runtime

    n = 1 << 22  # 16 MiB of fp32: a block of its own in the allocator's large pool
    _init(ctx)
    shard = torch.randn(n, device=ctx.device)
    runtime.register_z3_param(1, [n], shard, None)
    runtime.register_graph(GRAPH, [1], 3)
    # One gather first: the first collective pays one-time costs (communicator set-up, kernel
    # loading) that can outlast the sleep below, and the test needs the lane still busy.
    torch.ops.dc.prefetch_params_fused(GRAPH, [], [1], None)
    torch.cuda.synchronize()
    runtime.invalidate_gathered_param(1)  # so that the next prefetch gathers again
    ptr = shard.data_ptr()
    lane = runtime.lane_stream("allgather")
    with torch.cuda.stream(lane):
        torch.cuda._sleep(SLEEP_CYCLES)
    torch.ops.dc.prefetch_params_fused(GRAPH, [], [1], None)  # queued behind the sleep
    assert not lane.query(), "the lane finished its sleep before the shard was freed: the test proves nothing"
    shard.untyped_storage().resize_(0)  # what offload does to a shard; the registry shares the storage
    again = torch.empty(n, device=ctx.device)
    reused = again.data_ptr() == ptr
    torch.cuda.synchronize()
    runtime.cleanup()
    assert not reused, "the shard's block was handed out again while the all-gather lane had yet to read it"


def _grad_target_body(ctx):
    from deepcompile import runtime

    n = 1 << 22
    _init(ctx, bucket=n)
    shard = torch.randn(n, device=ctx.device)
    target = torch.zeros(n, device=ctx.device)
    runtime.register_z3_param(1, [n], shard, target)
    runtime.register_graph(GRAPH, [1], 3)
    grad = torch.randn(n, device=ctx.device)
    # One backward first: the first reduction pays one-time costs (communicator set-up, kernel
    # loading) that can outlast the sleep below, and the test needs the lane still busy.
    for warm_up in (True, False):
        runtime.start_backward(True)
        torch.cuda.synchronize()
        ptr = target.data_ptr()
        lane = runtime.lane_stream("reduce-scatter")
        if not warm_up:
            with torch.cuda.stream(lane):
                torch.cuda._sleep(SLEEP_CYCLES)
        torch.ops.dc.reduce_grad(grad, GRAPH, 1)
        torch.ops.dc.end_backward([], GRAPH, False)  # the flush writes the target behind the sleep
    assert not lane.query(), "the lane finished its sleep before the target was freed: the test proves nothing"
    target.untyped_storage().resize_(0)
    again = torch.empty(n, device=ctx.device)
    reused = again.data_ptr() == ptr
    torch.cuda.synchronize()
    runtime.cleanup()
    assert not reused, "the gradient target's block was handed out again while the reduce lane had yet to write it"


def _nccl_trace_body(ctx):
    from deepcompile import runtime

    out: list = []
    os.environ["DC_DEBUG_COLLECTIVES"] = "1"  # read when a communicator is built
    try:
        with _captured_stderr(out):
            _init(ctx)
            shard = torch.randn(1024, device=ctx.device)
            runtime.register_z3_param(1, [1024], shard, None)
            runtime.register_graph(GRAPH, [1], 3)
            full = torch.ops.dc.allgather_param(shard, GRAPH, 1, None)
            torch.ops.dc.wait_allgather(full, GRAPH, 1)
            torch.cuda.synchronize()
            runtime.cleanup()
    finally:
        os.environ.pop("DC_DEBUG_COLLECTIVES", None)
    text = out[0]
    assert "[deepcompile rank 0] #1 allgather-ints numel=" in text, text
    assert "allgather numel=1024" in text, text


def _pinned_body(ctx):
    from deepcompile import _C, runtime

    _init(ctx)
    shard = torch.randn(256, device=ctx.device)
    runtime.register_z3_param(1, [256], shard, None)
    pinned_out: list = []
    with _captured_stderr(pinned_out):
        runtime.set_host_shard(1, _C.pinned_host_buffer(256 * 4).view(torch.float32))
    pageable_out: list = []
    with _captured_stderr(pageable_out):
        runtime.set_host_shard(1, torch.empty(256))
    runtime.set_host_shard(1, None)
    runtime.cleanup()
    assert "pageable" not in pinned_out[0], pinned_out[0]
    assert "is in pageable (not page-locked) host memory" in pageable_out[0], pageable_out[0]


def _other_gpu_body(ctx):
    from deepcompile import runtime

    _init(ctx)
    shard = torch.randn(256, device=ctx.device)
    runtime.register_z3_param(1, [256], shard, torch.zeros(256, device=ctx.device))
    runtime.register_graph(GRAPH, [1], 3)
    other = torch.device("cuda", 1 - ctx.device.index)
    refused = rf"is on {other} but the deepcompile runtime was initialized for {ctx.device}"
    with pytest.raises(RuntimeError, match=refused):
        torch.ops.dc.reduce_grad(torch.ones(256, device=other), GRAPH, 1)
    runtime.cleanup()


@pytest.mark.gpu
def test_gather_source_is_recorded_on_the_gather_lane():
    run_distributed(_gather_source_body, 1, timeout=300)


@pytest.mark.gpu
def test_grad_target_is_recorded_on_the_reduce_lane():
    run_distributed(_grad_target_body, 1, timeout=300)


@pytest.mark.gpu
def test_nccl_collectives_are_traced():
    run_distributed(_nccl_trace_body, 1, timeout=300)


@pytest.mark.gpu
def test_pageable_host_shard_is_warned_about():
    run_distributed(_pinned_body, 1, timeout=300)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_on_another_gpu_is_refused_naming_both():
    run_distributed(_other_gpu_body, 1, timeout=300)
