"""Reference data, ZeRO layouts and checks shared by the op tests in ``tests/runtime/``.

The op tests run a module-level body on several ranks (gloo on CPU; NCCL on GPUs with
``DC_TEST_DEVICE=cuda``) through ``_harness.multiproc.run_distributed`` and check real values
against an eager reference built here:

* a parameter's full value comes from a generator seeded by its ds id, identical on every rank;
  its ZeRO-3 shard is this rank's ``ppr``-element slice of the zero-padded flat parameter;
* each rank's gradient comes from a generator seeded by (ds id, rank, micro-step), so ranks
  differ; the reference reduced gradient is ``dist.all_reduce(full grad) / world_size``, sliced
  to this rank's part with the layouts documented in ``deepcompile/runtime.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist

from deepcompile import runtime
from deepcompile.runtime import RuntimeConfig

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
        # Elements of this rank's slice at or past the true numel are padding. They must be
        # exactly zero (DeepSpeed's reduce wrote another gradient's values there).
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
# bad input: ids nobody registered, and what the resulting error messages must mention
# ----------------------------------------------------------------------------------------------

UNKNOWN_GRAPH = 424242
UNKNOWN_ID = 9999
# The patterns of errors about an id name that id and the reason, so that another error of the same
# op (a wrong shape, a wrong dtype, a different id) cannot pass for the one expected.


def re_unknown_graph(graph_id: int) -> str:
    return rf"graph id {graph_id} is not registered"


def re_unknown_id(ds_id: int) -> str:
    return rf"unknown ds id {ds_id}: no parameter with this id is registered"


def re_not_in_graph(ds_id: int, graph_id: int) -> str:
    return rf"ds id {ds_id} is not a parameter of graph {graph_id}"


def re_wrong_stage(graph_id: int, stage: int) -> str:
    return rf"needs a ZeRO-3 executor, but graph id {graph_id} was registered for ZeRO-{stage}"


RE_NOT_INIT = r"(?i)(initiali[sz]|not init)"
RE_USERS = r"(?i)(n_users|users|inconsistent|count)"
