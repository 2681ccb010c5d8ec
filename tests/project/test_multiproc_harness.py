"""Self-test of the multi-process harness (tests/multiproc.py): a failing rank, a rank that dies
in C++ and a hang must each fail the calling test with a useful report, never block CI, and the
next test must still get working ranks. Needs no deepcompile."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from _harness.multiproc import DistributedTestFailure, require_world_size, run_distributed


def _body_all_reduce(ctx, value):
    t = torch.full((1,), float(ctx.rank + value), device=ctx.device)
    dist.all_reduce(t)
    expected = sum(r + value for r in range(ctx.world_size))
    assert t.item() == expected, (t.item(), expected)


def _body_one_rank_raises(ctx):
    if ctx.rank == ctx.world_size - 1:
        raise ValueError(f"planted failure on rank {ctx.rank}")
    dist.barrier()


def _body_one_rank_aborts(ctx):
    if ctx.rank == 0:
        os.abort()  # what a failed C++ assert does
    dist.barrier()


def _body_one_rank_hangs(ctx):
    if ctx.rank == 0:
        time.sleep(60)


def test_ranks_share_a_process_group(dist_world_size):
    run_distributed(_body_all_reduce, dist_world_size, args=(3,))
    run_distributed(_body_all_reduce, dist_world_size, args=(5,))  # the pool is reused


def test_failing_rank_is_reported(dist_world_size):
    with pytest.raises(DistributedTestFailure, match="planted failure on rank"):
        run_distributed(_body_one_rank_raises, dist_world_size)
    run_distributed(_body_all_reduce, dist_world_size, args=(1,))


@pytest.mark.world_size(2)
def test_dead_rank_is_reported():
    require_world_size(2)
    with pytest.raises(DistributedTestFailure, match="killed by signal"):
        run_distributed(_body_one_rank_aborts, 2)
    run_distributed(_body_all_reduce, 2, args=(1,))


@pytest.mark.world_size(2)
def test_hang_times_out():
    require_world_size(2)
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure, match="did not finish"):
        run_distributed(_body_one_rank_hangs, 2, timeout=5)
    assert time.monotonic() - start < 40
    run_distributed(_body_all_reduce, 2, args=(1,))
