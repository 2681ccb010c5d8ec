"""Run a test body in N processes that share a torch.distributed process group.

Usage (from a test)::

    def _body(ctx, shapes):          # module level, so that it pickles by reference
        ctx.init_runtime()
        ...                          # asserts; ctx.rank, ctx.world_size, ctx.device

    def test_something():
        run_distributed(_body, world_size=2, args=((5, 3),))

Every rank runs ``body(ctx, *args)``. If any rank raises, the parent raises
:class:`DistributedTestFailure` carrying every failing rank's traceback text. A body that hangs
(or a rank that dies, e.g. a C++ abort or segfault in the extension) fails the test after
``timeout`` seconds (or as soon as the death is seen) instead of blocking CI.

Backends:

* default: gloo on CPU, ``ctx.device == torch.device("cpu")``;
* ``DC_TEST_DEVICE=cuda``: NCCL, rank ``r`` on ``cuda:r`` and ``ctx.init_runtime()`` passes
  ``device="cuda"``. The tests take their world size from :func:`world_sizes` or
  :func:`single_world_size`, which fit it to ``torch.cuda.device_count()`` (one GPU: world size
  1); a test that needs more ranks than there are GPUs is skipped with the reason
  (:func:`require_world_size`, also called by :func:`run_distributed`), never failed.

Worker processes are spawned (never forked) and, to keep the suite fast on small machines, kept
in a pool per (world size, device) and reused by later tests. Between two bodies every worker
calls ``deepcompile.runtime.cleanup()`` and the ranks check they ran the same number of bodies
(one all-reduce), so state cannot leak silently. Any failure or timeout tears the pool down, so
the next test starts from fresh processes. ``DC_TEST_FRESH_PROCS=1`` spawns fresh processes for
every body (slower; useful to rule out cross-test interference). Every process group is
destroyed when its pool shuts down.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

DEFAULT_TIMEOUT_S = 120.0
# Collectives inside a body give up after this long (gloo/NCCL raise in the worker, so a hang is
# reported with a traceback of where each rank was waiting). Kept below the per-body timeout.
COLLECTIVE_TIMEOUT_S = 90.0
_STARTUP_TIMEOUT_S = 120.0
# After one rank reported an error, how long to wait for the others' reports before killing them.
_ERROR_GRACE_S = 10.0


def test_device_type() -> str:
    """``"cuda"`` when ``DC_TEST_DEVICE=cuda``, else ``"cpu"``."""
    dev = os.environ.get("DC_TEST_DEVICE", "cpu").strip().lower() or "cpu"
    if dev not in ("cpu", "cuda"):
        raise ValueError(f"DC_TEST_DEVICE must be 'cpu' or 'cuda', got {dev!r}")
    return dev


def requested_world_sizes() -> Optional[Tuple[int, ...]]:
    """The world sizes listed in ``DC_TEST_WORLD_SIZES`` (comma-separated, e.g. ``4`` or ``2,4``),
    or None when it is unset or empty."""
    raw = os.environ.get("DC_TEST_WORLD_SIZES", "").strip()
    if not raw:
        return None
    try:
        sizes = tuple(int(part) for part in raw.split(",") if part.strip())
    except ValueError:
        sizes = ()
    if not sizes or any(n < 1 for n in sizes):
        raise ValueError(f"DC_TEST_WORLD_SIZES must list world sizes >= 1, e.g. '2,4'; got {raw!r}")
    return sizes


def world_sizes(default: Sequence[int] = (2, 3)) -> Tuple[int, ...]:
    """World sizes of the suites parametrized over it.

    ``DC_TEST_WORLD_SIZES`` when set (sizes the device cannot host are skipped by
    :func:`require_world_size`, with the reason). Otherwise ``default``, except on GPUs
    (``DC_TEST_DEVICE=cuda``) when none of ``default`` fits the GPUs present: then one rank per
    GPU, so a one-GPU machine runs the suites at world size 1 instead of skipping them all. With
    at least one default size that fits, the defaults stay, and larger ones skip with the reason
    (on 2 GPUs: 2 runs, 3 skips).
    """
    requested = requested_world_sizes()
    if requested is not None:
        return requested
    limit = max_world_size()
    if limit is not None and limit >= 1 and not any(n <= limit for n in default):
        return (limit,)
    return tuple(default)


def single_world_size(default: int = 2) -> int:
    """World size of the suites that run at one size (parity, GPU memory lifetimes, stream
    stress): the largest of ``DC_TEST_WORLD_SIZES`` when set, else ``default``; on GPUs capped at
    the GPU count, so these suites never ask for GPUs the machine does not have (one GPU: world
    size 1). With no GPU at all the size stays uncapped and :func:`run_distributed` skips."""
    requested = requested_world_sizes()
    size = max(requested) if requested is not None else default
    limit = max_world_size()
    if limit is not None and limit >= 1:
        size = min(size, limit)
    return size


def max_world_size(device_type: Optional[str] = None) -> Optional[int]:
    """Largest world size the device can run (None: unlimited, CPU)."""
    device_type = device_type or test_device_type()
    if device_type == "cuda":
        import torch

        return torch.cuda.device_count()
    return None


def ws_id(world_size: int) -> str:
    """The test-id part that names a world size (``ws2``): every distributed test shows the world
    size it runs at in its id (conftest.py checks it), so a suite run at one rank, where gathers,
    reduce-scatters and averaging are identities, cannot pass for a multi-rank run."""
    return f"ws{world_size}"


# The world sizes run_distributed ran bodies at since conftest.py last cleared it (once per test).
ran_world_sizes: List[int] = []


def require_world_size(world_size: int) -> None:
    """Skip the calling test (with a reason) when the device cannot host ``world_size`` ranks.

    For tests that need that many ranks (a failing rank next to a healthy one, 3- and 4-rank
    sharding); the others pick a size the device can host (:func:`world_sizes`,
    :func:`single_world_size`)."""
    import pytest

    limit = max_world_size()
    if limit is not None and world_size > limit:
        pytest.skip(f"needs {world_size} GPUs, {limit} available (DC_TEST_DEVICE=cuda)")


class DistributedTestFailure(AssertionError):
    """A rank raised, died or timed out; the message holds every rank's report."""


@dataclasses.dataclass
class DistContext:
    """What a body gets: its rank, the world size, the device and the backend."""

    rank: int
    world_size: int
    device_type: str
    backend: str

    @property
    def device(self):
        import torch

        if self.device_type == "cuda":
            return torch.device("cuda", self.rank)
        return torch.device("cpu")

    def init_runtime(self, config=None, process_group=None) -> None:
        """``deepcompile.runtime.init`` for this device (``device='cuda'`` under DC_TEST_DEVICE)."""
        from deepcompile import runtime

        runtime.init(process_group=process_group, config=config, device=self.device_type)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------------------------


def _cleanup_runtime() -> None:
    mod = sys.modules.get("deepcompile.runtime")
    if mod is not None:
        mod.cleanup()


def _worker_main(rank, world_size, port, device_type, task_q, result_q) -> None:
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(rank)
            # When a failed body tears the pool down, surviving ranks' NCCL heartbeat would spam
            # "Broken pipe" warnings until they are killed.
            os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        ctx = DistContext(rank=rank, world_size=world_size, device_type=device_type, backend=backend)
        result_q.put((rank, -1, "ok", ""))
    except BaseException:  # noqa: BLE001  (report, never hang the parent)
        result_q.put((rank, -1, "error", traceback.format_exc()))
        return

    done = 0
    try:
        while True:
            item = task_q.get()
            if item is None:
                break
            seq, fn, args, kwargs = item
            try:
                fn(ctx, *args, **kwargs)
                _cleanup_runtime()
                # All ranks must have completed the same number of bodies: catches a body whose
                # ranks silently diverged before the pool is reused.
                done += 1
                t = torch.tensor([done], dtype=torch.int64, device=ctx.device)
                lo, hi = t.clone(), t.clone()
                dist.all_reduce(lo, op=dist.ReduceOp.MIN)
                dist.all_reduce(hi, op=dist.ReduceOp.MAX)
                if lo.item() != done or hi.item() != done:
                    raise RuntimeError(
                        f"ranks out of step after body {fn.__qualname__}: rank {rank} finished "
                        f"{done} bodies, others between {lo.item()} and {hi.item()}"
                    )
                result_q.put((rank, seq, "ok", ""))
            except BaseException:  # noqa: BLE001
                try:
                    _cleanup_runtime()
                except BaseException:  # noqa: BLE001
                    pass
                result_q.put((rank, seq, "error", traceback.format_exc()))
                # The group's collective sequence may be out of step now: stop; the parent drops
                # this pool and kills its processes.
                return
    finally:
        try:
            _cleanup_runtime()
        except BaseException:  # noqa: BLE001
            pass
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except BaseException:  # noqa: BLE001
                pass


# --------------------------------------------------------------------------------------------
# parent side
# --------------------------------------------------------------------------------------------


class _Pool:
    def __init__(self, world_size: int, device_type: str) -> None:
        self.world_size = world_size
        self.device_type = device_type
        self._ctx = mp.get_context("spawn")
        self._result_q = self._ctx.Queue()
        self._task_qs = [self._ctx.Queue() for _ in range(world_size)]
        self._seq = 0
        self.broken = False
        port = _free_port()
        self._procs = [
            self._ctx.Process(
                target=_worker_main,
                args=(r, world_size, port, device_type, self._task_qs[r], self._result_q),
                name=f"dc-test-rank{r}",
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        try:
            self._collect(-1, _STARTUP_TIMEOUT_S, what="process-group setup")
        except BaseException:
            self.shutdown()
            raise

    def run(self, fn: Callable, args: Tuple, kwargs: Dict[str, Any], timeout: float) -> None:
        __tracebackhide__ = True  # pytest: show the ranks' tracebacks, not this harness
        self._seq += 1
        for q in self._task_qs:
            q.put((self._seq, fn, args, kwargs))
        try:
            self._collect(self._seq, timeout, what=getattr(fn, "__qualname__", repr(fn)))
        except BaseException:
            self.shutdown()
            raise

    def _collect(self, seq: int, timeout: float, what: str) -> None:
        __tracebackhide__ = True
        reports: Dict[int, Tuple[str, str]] = {}
        deadline = time.monotonic() + timeout
        first_error_at: Optional[float] = None
        while len(reports) < self.world_size:
            now = time.monotonic()
            if first_error_at is not None and now > first_error_at + _ERROR_GRACE_S:
                break
            if now > deadline:
                break
            try:
                rank, rseq, status, text = self._result_q.get(timeout=0.2)
            except queue.Empty:
                dead = [
                    (r, p.exitcode)
                    for r, p in enumerate(self._procs)
                    if r not in reports and p.exitcode is not None
                ]
                for r, code in dead:
                    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                    reports[r] = ("died", f"process ended ({how}) without reporting; "
                                          "a C++ abort/segfault shows up this way")
                    if first_error_at is None:
                        first_error_at = time.monotonic()
                continue
            if rseq != seq:
                continue  # stale report of an earlier body; cannot happen unless a pool is reused after a failure
            reports[rank] = (status, text)
            if status != "ok" and first_error_at is None:
                first_error_at = time.monotonic()

        failed = {r: rep for r, rep in reports.items() if rep[0] != "ok"}
        missing = [r for r in range(self.world_size) if r not in reports]
        if not failed and not missing:
            return
        lines = [
            f"{what} failed on world_size={self.world_size} ({self.device_type}): "
            f"{len(failed)} rank(s) failed, {len(missing)} rank(s) did not finish"
            + ("" if failed else f" within {timeout:.0f}s (hang?)")
        ]
        for r in sorted(failed):
            status, text = failed[r]
            lines.append(f"\n----- rank {r} ({status}) -----\n{text.rstrip()}")
        if missing:
            lines.append(f"\n----- ranks still running (killed): {missing} -----")
        raise DistributedTestFailure("\n".join(lines))

    def shutdown(self) -> None:
        self.broken = True
        for q in self._task_qs:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)


_POOLS: Dict[Tuple[int, str], _Pool] = {}


def shutdown_pools() -> None:
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.shutdown()


atexit.register(shutdown_pools)


def run_distributed(
    fn: Callable,
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: Optional[Dict[str, Any]] = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` ranks; raise if any rank fails or hangs.

    ``fn`` and the arguments must be picklable (module-level functions, plain data).
    """
    __tracebackhide__ = True
    if getattr(fn, "__qualname__", "").count("<locals>") or getattr(fn, "__name__", "") == "<lambda>":
        raise ValueError("run_distributed needs a module-level function (it is pickled by name)")
    device_type = test_device_type()
    # A size the GPUs cannot host skips the test (with the reason) rather than failing it: a
    # machine with fewer GPUs is not a defect of the code under test.
    require_world_size(world_size)
    ran_world_sizes.append(world_size)
    kwargs = dict(kwargs or {})
    fresh = os.environ.get("DC_TEST_FRESH_PROCS", "0") not in ("", "0", "false", "False")
    key = (world_size, device_type)
    pool = None if fresh else _POOLS.get(key)
    if pool is None or pool.broken:
        # Keep one pool alive at a time: the machines this runs on are small.
        shutdown_pools()
        pool = _Pool(world_size, device_type)
        if not fresh:
            _POOLS[key] = pool
    try:
        pool.run(fn, tuple(args), kwargs, timeout)
    finally:
        if fresh or pool.broken:
            _POOLS.pop(key, None)
            pool.shutdown()
