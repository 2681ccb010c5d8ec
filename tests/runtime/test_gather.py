"""Multi-process tests of the ``torch.ops.dc`` op library and the runtime control API.

Every test runs a module-level body on 2 and 3 ranks (gloo on CPU; NCCL on GPUs with
``DC_TEST_DEVICE=cuda``) through ``multiproc.run_distributed`` and checks real values against an
eager reference built in the test:

* a parameter's full value comes from a generator seeded by its ds id, identical on every rank;
  its ZeRO-3 shard is this rank's ``ppr``-element slice of the zero-padded flat parameter;
* each rank's gradient comes from a generator seeded by (ds id, rank, micro-step), so ranks
  differ; the reference reduced gradient is ``dist.all_reduce(full grad) / world_size``, sliced
  to this rank's part with the layouts documented in ``deepcompile/runtime.py``.

References to "DS gap N" are the rows of runtime-ops.md §7.1 (DeepSpeed defects our runtime must
not have); "seed 000/001" are the lifetime fixes ARCHITECTURE.md §3.4 turns into invariants.
"""

from __future__ import annotations

import dataclasses
import gc
import re
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from deepcompile import runtime
from deepcompile.runtime import RuntimeConfig
from _harness.multiproc import run_distributed

ops = torch.ops.dc

GRAPH = 1
GRAPH2 = 2
# Small buckets: the default (5e8 elements) would reserve gigabytes per rank and dtype.
CONFIG = RuntimeConfig(reduce_bucket_size=1024)
TINY_BUCKET = RuntimeConfig(reduce_bucket_size=8)

# (ds_id, shape, dtype). Numels 15, 7, 1, 16: none but 16 divisible by 3, and 15, 7, 1 not by 2.
# The ids are neither 0-based nor contiguous, so an id-vs-index mix-up shows.
FP32_SPECS = [
    (11, (5, 3), torch.float32),
    (23, (7,), torch.float32),
    (5, (1,), torch.float32),
    (40, (4, 4), torch.float32),
]
BF16_SPECS = [
    (77, (3, 3), torch.bfloat16),
    (8, (2, 5), torch.bfloat16),
]
MIXED_SPECS = FP32_SPECS + BF16_SPECS
STAGES = (1, 2, 3)

BF16_TOL = dict(rtol=2e-2, atol=3e-2)


def _tol(dtype: torch.dtype) -> dict:
    return BF16_TOL if dtype in (torch.bfloat16, torch.float16) else {}


# ----------------------------------------------------------------------------------------------
# reference data and layouts
# ----------------------------------------------------------------------------------------------


def ppr_of(numel: int, world: int) -> int:
    """Elements per rank of a ZeRO-3 parameter: ceil(numel / world)."""
    return -(-numel // world)


def numel_of(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def full_param(ds_id: int, shape, dtype, device) -> torch.Tensor:
    """The full parameter: same on every rank (seeded by the ds id)."""
    g = torch.Generator().manual_seed(1_000 + ds_id)
    return torch.randn(shape, generator=g).to(dtype=dtype, device=device)


def z3_shard(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's ZeRO-3 shard: slice ``[rank*ppr, (rank+1)*ppr)`` of the zero-padded flat param."""
    n = full.numel()
    p = ppr_of(n, world)
    flat = torch.zeros(world * p, dtype=full.dtype, device=full.device)
    flat[:n] = full.reshape(-1)
    return flat[rank * p : (rank + 1) * p].clone()


def rank_grad(ds_id: int, shape, rank: int, step: int, dtype, device) -> torch.Tensor:
    """This rank's gradient of ``ds_id`` at micro-step ``step`` (different on every rank)."""
    g = torch.Generator().manual_seed(100_000 * step + 1_000 * rank + ds_id)
    return torch.randn(shape, generator=g).to(dtype=dtype, device=device)


def averaged_full_grad(grad: torch.Tensor) -> torch.Tensor:
    """Eager reference: (sum over ranks of each rank's gradient) / world, in fp32, flattened."""
    g = grad.detach().to(torch.float32).reshape(-1).clone()
    dist.all_reduce(g)
    return g / dist.get_world_size()


@dataclasses.dataclass
class Param:
    """One registered parameter and where its reduced gradient lands on this rank."""

    ds_id: int
    shape: Tuple[int, ...]
    dtype: torch.dtype
    stage: int
    target: torch.Tensor
    lo: int  # elements [lo, hi) of the padded (ZeRO-3) or plain (ZeRO-1/2) flat gradient
    hi: int
    shard: Optional[torch.Tensor] = None  # ZeRO-3 only

    @property
    def numel(self) -> int:
        return numel_of(self.shape)

    def expected(self, avg_full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the averaged gradient (fp32), per runtime.py's layouts."""
        if self.stage == 3:
            world = dist.get_world_size()
            padded = torch.zeros(world * ppr_of(self.numel, world), dtype=torch.float32, device=avg_full.device)
            padded[: self.numel] = avg_full
            return padded[self.lo : self.hi]
        return avg_full[self.lo : self.hi]


def z12_layout(specs, world: int) -> Tuple[Dict[int, int], int]:
    """One parameter group: group offsets of the params in order, and partition_numel."""
    offsets, off = {}, 0
    for ds_id, shape, _ in specs:
        offsets[ds_id] = off
        off += numel_of(shape)
    return offsets, ppr_of(off, world)


def z12_overlap(offset: int, numel: int, partition_numel: int, rank: int) -> Tuple[int, int]:
    """Elements [lo, hi) of a param (relative to the param) inside this rank's partition."""
    start, end = rank * partition_numel, (rank + 1) * partition_numel
    lo, hi = max(offset, start), min(offset + numel, end)
    if hi <= lo:
        return 0, 0
    return lo - offset, hi - offset


def register_params(
    ctx,
    stage: int,
    specs,
    expected_grad_dtypes: Optional[Dict[int, torch.dtype]] = None,
    target_dtypes: Optional[Dict[int, torch.dtype]] = None,
) -> Dict[int, Param]:
    """Register ``specs`` for ``stage`` and give each a gradient target (the param's dtype unless
    ``target_dtypes`` says otherwise). Returns ds_id -> Param."""
    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    expected_grad_dtypes = expected_grad_dtypes or {}
    target_dtypes = target_dtypes or {}
    params: Dict[int, Param] = {}
    if stage == 3:
        shards, targets = [], []
        for ds_id, shape, dtype in specs:
            p = ppr_of(numel_of(shape), world)
            shard = z3_shard(full_param(ds_id, shape, dtype, dev), world, rank)
            target = torch.zeros(p, dtype=target_dtypes.get(ds_id, dtype), device=dev)
            params[ds_id] = Param(ds_id, tuple(shape), dtype, 3, target, rank * p, (rank + 1) * p, shard)
            shards.append(shard)
            targets.append(target)
        runtime.register_z3_params(
            [s[0] for s in specs],
            [s[1] for s in specs],
            shards,
            targets,
            expected_grad_dtypes=[expected_grad_dtypes.get(s[0]) for s in specs],
        )
        return params
    offsets, pn = z12_layout(specs, world)
    for ds_id, shape, dtype in specs:
        n = numel_of(shape)
        runtime.register_z12_param(ds_id, shape, full_param(ds_id, shape, dtype, dev), offsets[ds_id], pn)
        lo, hi = z12_overlap(offsets[ds_id], n, pn, rank)
        target = torch.zeros(hi - lo, dtype=target_dtypes.get(ds_id, dtype), device=dev)
        runtime.bind_grad_target(ds_id, target)
        params[ds_id] = Param(ds_id, tuple(shape), dtype, stage, target, lo, hi)
    return params


def check_target(p: Param, expected: torch.Tensor, what: str) -> None:
    """Compare a gradient target with its reference; the ZeRO-3 padding tail must be exactly 0."""
    got = p.target.detach().to("cpu", torch.float32)
    exp = expected.detach().to("cpu", torch.float32)
    assert got.shape == exp.shape, f"{what}: ds_id {p.ds_id}: target numel {got.numel()}, expected {exp.numel()}"
    torch.testing.assert_close(got, exp, **_tol(p.target.dtype), msg=lambda m: f"{what}: ds_id {p.ds_id}: {m}")
    if p.stage == 3:
        # Elements of this rank's slice at or past the true numel are padding (DS gap 5: they
        # received another gradient's values). They must be exactly zero.
        valid = max(0, min(p.hi, p.numel) - p.lo)
        tail = got[valid:]
        assert torch.count_nonzero(tail) == 0, f"{what}: ds_id {p.ds_id}: padding tail not zero: {tail.tolist()}"


def reduce_step(
    ctx,
    params: Dict[int, Param],
    graph_id: int,
    step: int,
    ids: Optional[Sequence[int]] = None,
    release_buckets: bool = True,
    end: bool = True,
    grad_dtypes: Optional[Dict[int, torch.dtype]] = None,
) -> Dict[int, torch.Tensor]:
    """One backward of ``graph_id``: reduce_grad for ``ids`` then end_backward.

    Returns ds_id -> the averaged full gradient (fp32 reference) of this micro-step. Also checks
    what every backward must satisfy: reduce_grad returns a numel-0 tensor of the gradient's
    dtype/device, does not modify its input (the schema declares no mutation), and end_backward
    leaves no pending reduce task.
    """
    ids = list(params) if ids is None else list(ids)
    grad_dtypes = grad_dtypes or {}
    grads = {
        i: rank_grad(i, params[i].shape, ctx.rank, step, grad_dtypes.get(i, params[i].dtype), ctx.device)
        for i in ids
    }
    refs = {i: averaged_full_grad(g) for i, g in grads.items()}
    originals = {i: g.clone() for i, g in grads.items()}
    outs = []
    for i in ids:
        out = ops.reduce_grad(grads[i], graph_id, i)
        assert out.numel() == 0, f"reduce_grad must return an empty tensor, got shape {tuple(out.shape)}"
        assert out.dtype == grads[i].dtype and out.device == grads[i].device
        outs.append(out)
    if end:
        ops.end_backward(outs, graph_id, release_buckets)
        assert runtime.pending_reduce_tasks() == 0, "end_backward left reduce tasks pending"
        if release_buckets:
            assert runtime.reduce_bucket_numel() == 0, "end_backward(release_reduce_buckets=True) kept buckets"
    for i in ids:
        # ZeRO-1 accumulates unreduced gradients locally; DeepSpeed kept the first gradient tensor
        # itself and add_'ed into it, silently changing the caller's tensor.
        assert torch.equal(grads[i], originals[i]), f"reduce_grad modified its input gradient (ds_id {i})"
    return refs


class ErrorChecks:
    """Runs many bad calls, records every one that did not raise a matching RuntimeError, and
    reports them all at once (instead of stopping at the first)."""

    def __init__(self) -> None:
        self.problems: List[str] = []

    def expect(self, what: str, pattern: str, fn, *args, **kwargs) -> None:
        try:
            with pytest.raises(RuntimeError, match=pattern):
                fn(*args, **kwargs)
        except BaseException as e:  # pytest's Failed is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            self.problems.append(f"{what}: {type(e).__name__}: {e}")

    def assert_none(self) -> None:
        assert not self.problems, "bad calls not rejected as expected:\n  " + "\n  ".join(self.problems)


def gather(shard: torch.Tensor, graph_id: int, ds_id: int, dtype=None) -> torch.Tensor:
    out = ops.allgather_param(shard, graph_id, ds_id, dtype)
    return ops.wait_allgather(out, graph_id, ds_id)


def storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


# Freed tensors keep their shape over a 0-byte storage: printing one reads freed memory. These
# helpers assert on the byte count only, so a failure reports instead of crashing the rank.
def assert_freed(t: torch.Tensor, what: str) -> None:
    n = storage_nbytes(t)
    assert n == 0, f"{what}: storage still holds {n} bytes (expected freed)"


def assert_alive(t: torch.Tensor, what: str) -> None:
    n = storage_nbytes(t)
    assert n > 0, f"{what}: storage was freed (expected kept)"


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def setup_z3(ctx, specs, config=CONFIG, graph_id=GRAPH, persistent=None):
    """init + register ZeRO-3 params + one stage-3 graph; returns (fulls, shards) by ds id."""
    ctx.init_runtime(config)
    fulls = {i: full_param(i, shape, dtype, ctx.device) for i, shape, dtype in specs}
    shards = {i: z3_shard(fulls[i], ctx.world_size, ctx.rank) for i, _, _ in specs}
    runtime.register_z3_params(
        [s[0] for s in specs],
        [s[1] for s in specs],
        [shards[s[0]] for s in specs],
        [None] * len(specs),
        persistent=[bool(persistent and s[0] in persistent) for s in specs],
    )
    runtime.register_graph(graph_id, [s[0] for s in specs], 3)
    return fulls, shards


# ----------------------------------------------------------------------------------------------
# all-gather
# ----------------------------------------------------------------------------------------------


def _body_allgather_uneven(ctx):
    """allgather_param returns exactly the full parameter for numels not divisible by the world
    size, in the requested dtype (fused cast), or in the shard's dtype when none is requested (a
    bf16 shard gathers as bf16: the run-time side of DS gap 7)."""
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
    requested after a shard-dtype prefetch must convert only after the gather completed (DS gap
    3: it converted stale bytes)."""
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
    used by another graph: its gather and wait get that buffer, complete. DS gap 10: DeepSpeed
    keeps the gather's event per executor, so a graph other than the one that gathered did not
    wait for it. Large parameters, so reading a gather still in flight would show."""
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
    values in the REQUESTED dtype (DS gap 2 returned the old fp32 buffer), an fp32 request is
    exact again (never an up-cast of a bf16 copy), and a param registered persistent=True can be
    gathered more than once (DS gap 4)."""
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
        episode(i, None, fulls[i], "second gather (DS gap 4)")

    # Simulated optimizer step: shards change in place, gathered copies become stale.
    for i in (A, B):
        shards[i].add_(1)
    runtime.invalidate_all_gathered()
    for i in (A, B):
        assert not runtime.is_gathered(i), f"ds_id {i}: still valid after invalidate_all_gathered"
    for i in (A, B):
        episode(i, bf16, fulls[i] + 1, "bf16 after update (DS gap 2)")
        episode(i, None, fulls[i] + 1, "fp32 after a bf16 gather")

    # Another step; prefetch in the shard dtype then request bf16 (valid-path conversion, DS gap 3).
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
    keeps it alive (seed 000). A second gather episode works afterwards."""
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
    assert_freed(buf, "the registry's padded buffer after the final release (seed 000)")
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


# ----------------------------------------------------------------------------------------------
# reduce
# ----------------------------------------------------------------------------------------------


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
    update step runs on released buckets: DeepSpeed's ZeRO-1 aborted there (DS gap 1)."""
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
    of one step: its target gets the SUM (DS gap 6: the second graph overwrote the first)."""
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
    exactly zero (DS gap 5 read past each send slot into the next gradient / stale bucket bytes).
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
    """ZeRO-1 gradient targets are step-local (seed 001): registered without a target, bound to
    views of a fresh flat partition buffer before the update backward, and after the update
    backward released the buckets and the optimizer side called unbind_grad_targets, the runtime
    holds no target, no bucket, no pending task and no reference to the buffer's storage."""
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
            "unbind_grad_targets (seed 001)"
        )


def test_z1_step_local_grad_targets(dist_world_size):
    run_distributed(_body_z1_step_local_targets, dist_world_size)


# ----------------------------------------------------------------------------------------------
# bad input: Python exceptions, never aborts
# ----------------------------------------------------------------------------------------------

UNKNOWN_GRAPH = 424242
UNKNOWN_ID = 9999
RE_GRAPH = r"(?i)graph"
RE_UNKNOWN_ID = r"(?i)(ds.?id|param|unknown|not registered|not found|9999)"
RE_NOT_IN_GRAPH = r"(?i)(graph|not in|not part)"
RE_STAGE = r"(?i)(stage|zero.?3|z3|executor)"
RE_NOT_INIT = r"(?i)(initiali[sz]|not init)"
RE_USERS = r"(?i)(n_users|users|inconsistent|count)"


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
    chk.expect("unknown graph: allgather_param", RE_GRAPH, ops.allgather_param, x, gid, A)
    chk.expect("unknown graph: prefetch_params_fused", RE_GRAPH, ops.prefetch_params_fused, gid, [x], [A])
    chk.expect("unknown graph: wait_allgather", RE_GRAPH, ops.wait_allgather, x, gid, A)
    chk.expect("unknown graph: release_param", RE_GRAPH, ops.release_param, x, gid, A, 1)
    chk.expect("unknown graph: reduce_grad", RE_GRAPH, ops.reduce_grad, g, gid, A)
    chk.expect("unknown graph: end_backward", RE_GRAPH, ops.end_backward, [g], gid, False)

    for ds_id, pattern, label in ((UNKNOWN_ID, RE_UNKNOWN_ID, "unknown ds id"), (B, RE_NOT_IN_GRAPH, "id not in graph")):
        chk.expect(f"{label}: allgather_param", pattern, ops.allgather_param, x, GRAPH, ds_id)
        chk.expect(f"{label}: prefetch_params_fused", pattern, ops.prefetch_params_fused, GRAPH, [x], [ds_id])
        chk.expect(f"{label}: wait_allgather", pattern, ops.wait_allgather, x, GRAPH, ds_id)
        chk.expect(f"{label}: release_param", pattern, ops.release_param, x, GRAPH, ds_id, 1)
        chk.expect(f"{label}: reduce_grad", pattern, ops.reduce_grad, g, GRAPH, ds_id)

    chk.expect("unknown ds id: bind_grad_target", RE_UNKNOWN_ID, runtime.bind_grad_target, UNKNOWN_ID, torch.zeros(3, device=ctx.device))
    chk.expect("unknown ds id: set_persistent", RE_UNKNOWN_ID, runtime.set_persistent, UNKNOWN_ID)
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
    """A shard whose numel is not ppr on ANY rank makes EVERY rank raise at registration (DS
    gap 8: the check was tautological and mismatched NCCL counts followed). The failed batch
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
        chk.expect(f"stage {stage}: allgather_param", RE_STAGE, ops.allgather_param, x, gid, P)
        chk.expect(f"stage {stage}: prefetch_params_fused", RE_STAGE, ops.prefetch_params_fused, gid, [x], [P])
        chk.expect(f"stage {stage}: wait_allgather", RE_STAGE, ops.wait_allgather, x, gid, P)
        chk.expect(f"stage {stage}: release_param", RE_STAGE, ops.release_param, x, gid, P, 1)
    chk.assert_none()


def test_error_executor_of_wrong_stage(dist_world_size):
    run_distributed(_body_error_wrong_stage, dist_world_size)


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
        ("start_forward", runtime.start_forward, ()),
        ("end_forward", runtime.end_forward, ()),
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


# ----------------------------------------------------------------------------------------------
# init / cleanup, free_tensors
# ----------------------------------------------------------------------------------------------


def _body_init_cleanup(ctx):
    """cleanup twice is safe; init twice replaces the runtime; a new init after cleanup works and
    knows nothing of the old graphs (DS gap 12: leaked/double-freed state)."""
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
    with pytest.raises(RuntimeError, match=RE_GRAPH):
        ops.allgather_param(shard, GRAPH, A)
    register_and_gather()

    runtime.cleanup()
    runtime.cleanup()
    assert not runtime.is_initialized()
    ctx.init_runtime(CONFIG)
    with pytest.raises(RuntimeError, match=RE_GRAPH):
        ops.allgather_param(shard, GRAPH, A)
    register_and_gather()

    # cleanup drops everything the runtime held (DS gap 12 kept registry and buckets alive): the
    # shard, the gradient target, a persistent gathered buffer and the reduce buckets.
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
    """free_tensors frees tensors whose BYTE size exceeds free_activation_threshold (DS gap 9
    compared the element count with the byte threshold) and keeps the others intact."""
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
