"""Measuring one row of ``bench/train_bench.py`` on every rank (:func:`measure`: warm-up, timed steps,
traces, failures caught per row) and combining the ranks' measurements into the table's ``Row``
(:func:`combine`). What the columns mean: train_bench.py's docstring.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import sys
import time
import traceback
from typing import Dict, List, Optional

import torch

from train_core import GIB, Context, Runner, Unavailable, flops_per_token, sync, teardown
from train_report import Row
from train_rows import Method


@dataclasses.dataclass
class RankMeasurement:
    """What one rank measured for one method; rank 0 combines them into a Row."""

    status: str = "ok"
    note: str = ""
    step_times: List[float] = dataclasses.field(default_factory=list)  # seconds, measured steps
    compile_s: float = math.nan
    scheduled_s: Optional[float] = None
    warm_scheduled_s: Optional[float] = None
    peak_bytes: Optional[int] = None
    loss: float = math.nan
    losses: List[float] = dataclasses.field(default_factory=list)  # every step, warm-up included
    transfers: Optional[Dict[str, float]] = None
    comm_bytes: Optional[Dict[str, Dict[str, int]]] = None  # the last measured step's, per link


def time_to_schedule(step_seconds: List[float], scheduled: List[bool]) -> Optional[float]:
    """Seconds from the start of the first step to the end of the first scheduled one (None:
    no step ran the final plan compiled)."""
    for i, done in enumerate(scheduled):
        if done:
            return sum(step_seconds[: i + 1])
    return None


def compile_cache(mode: str):
    """The compile-cache state of one row (``--compile-cache``)."""
    if mode == "cold":
        from torch._inductor.utils import fresh_cache  # an empty cache dir, in-memory caches cleared

        return fresh_cache()
    return contextlib.nullcontext()


def warm_restart(ctx: Context, method: Method) -> Optional[float]:
    """Start ``method`` again on the caches left on disk (as a new process would find them)."""
    from torch._inductor.utils import clear_inductor_caches

    teardown(ctx)
    clear_inductor_caches()
    runner = method.build(ctx)
    try:
        times, scheduled = [], []
        for tokens in ctx.batches[: ctx.args.warmup]:
            sync(ctx)
            start = time.perf_counter()
            runner.step(tokens)
            sync(ctx)
            times.append(time.perf_counter() - start)
            scheduled.append(runner.scheduled())
            if scheduled[-1]:
                break
        return time_to_schedule(times, scheduled)
    finally:
        runner.close()
        del runner
        teardown(ctx)


def measure(ctx: Context, method: Method) -> RankMeasurement:
    with compile_cache(ctx.args.compile_cache):
        return _measure(ctx, method)


def _measure(ctx: Context, method: Method) -> RankMeasurement:
    m = RankMeasurement()
    if ctx.is_cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    runner: Optional[Runner] = None
    try:
        runner = method.build(ctx)
        times, scheduled = [], []
        loss = None
        for i, tokens in enumerate(ctx.batches):
            sync(ctx)
            start = time.perf_counter()
            loss = runner.step(tokens)
            sync(ctx)
            times.append(time.perf_counter() - start)
            m.losses.append(loss.detach().float().item())  # outside the timed region
            scheduled.append(runner.scheduled())
            if i == 0 and ctx.rank == 0:
                print(f"  first step (compile) {times[0]:.1f} s", flush=True)
            if i == ctx.args.warmup - 1 and ctx.is_cuda:
                torch.cuda.reset_peak_memory_stats(ctx.device)  # peak of the measured steps only
        m.compile_s = times[0]
        m.scheduled_s = time_to_schedule(times, scheduled)
        if ctx.rank == 0:
            print(f"  first scheduled step ends at {m.scheduled_s:.1f} s" if m.scheduled_s is not None
                  else "  no step ran the final plan compiled", flush=True)
        if not all(scheduled[ctx.args.warmup:]):
            raise RuntimeError("a measured step was not a compiled step of the final plan: raise --warmup")
        m.step_times = times[ctx.args.warmup:]
        m.comm_bytes = runner.comm_bytes()  # the last measured step's, before any traced step
        if ctx.args.trace:
            from step_trace import trace_steps

            m.transfers = trace_steps(runner.step, ctx.batches[: ctx.args.trace_steps], lambda: sync(ctx),
                                      os.path.join(ctx.args.trace, f"{method.key}.txt"), method.name,
                                      write=ctx.rank == 0, record_memory=ctx.args.trace_memory)
        if ctx.args.memory_history:
            from step_trace import record_memory_steps

            record_memory_steps(runner.step, ctx.batches[:1], lambda: sync(ctx),
                                os.path.join(ctx.args.memory_history, method.key), write=ctx.rank == 0,
                                stacks=ctx.args.memory_history_stacks)
        m.loss = loss.detach().float().item()
        m.note = runner.note()
        if ctx.is_cuda:
            m.peak_bytes = torch.cuda.max_memory_allocated(ctx.device)
    except Unavailable as e:
        m.status, m.note = "n/a", str(e)
    except torch.OutOfMemoryError as e:
        m.status, m.note = "OOM", str(e).split("\n")[0][:160]
    except Exception as e:  # one broken method must not cost the others their rows
        m.status, m.note = "error", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        print(f"[rank {ctx.rank}] {method.name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    finally:
        if runner is not None:
            try:
                runner.close()
            except Exception as e:
                print(f"[rank {ctx.rank}] {method.name}: close failed: {e!r}", file=sys.stderr, flush=True)
        del runner
        teardown(ctx)
    if ctx.args.warm_start and m.status == "ok":
        try:
            m.warm_scheduled_s = warm_restart(ctx, method)
        except Exception as e:  # the cold row stands; say why the warm number is missing
            m.note = (m.note + "; " if m.note else "") + f"warm start failed: {type(e).__name__}"
            print(f"[rank {ctx.rank}] {method.name} warm start failed:\n{traceback.format_exc()}", file=sys.stderr,
                  flush=True)
    return m


def combine(ctx: Context, method: Method, per_rank: List[RankMeasurement]) -> Row:
    row = Row(method.name, note=per_rank[0].note, layout=method.layout)
    bad = [(r, m) for r, m in enumerate(per_rank) if m.status != "ok"]
    if bad:
        rank, m = bad[0]
        row.status = m.status
        row.note = m.note if rank == 0 or m.status == "n/a" else f"rank {rank}: {m.note}"
        return row
    # The ranks wait for each other in collectives; the slowest rank is the step time.
    step_s = max(statistics.median(m.step_times) for m in per_rank)
    tokens = ctx.args.micro_batch * ctx.args.seq
    row.step_ms = step_s * 1e3
    row.tokens_per_s = tokens / step_s
    row.tflops = flops_per_token(ctx.args, ctx.n_params) * tokens / step_s / 1e12
    row.compile_s = max(m.compile_s for m in per_rank)
    row.scheduled_s = _max_or_none([m.scheduled_s for m in per_rank])
    row.warm_scheduled_s = _max_or_none([m.warm_scheduled_s for m in per_rank])
    if all(m.peak_bytes is not None for m in per_rank):
        row.peak_gib = max(m.peak_bytes for m in per_rank) / GIB
    row.loss = sum(m.loss for m in per_rank) / len(per_rank)
    row.losses = [sum(step) / len(step) for step in zip(*(m.losses for m in per_rank))]
    row.transfers = per_rank[0].transfers  # the trace is summarised on rank 0
    row.comm_bytes = per_rank[0].comm_bytes  # the ranks of a layout send alike (padded shards)
    return row


def _max_or_none(values: List[Optional[float]]) -> Optional[float]:
    return None if any(v is None for v in values) else max(values)

