"""Stream-race stress runs (2 ranks, 1 on a one-GPU machine; NCCL): overlapped against serialized
communication.

The runtime overlaps compute with communication on its own CUDA streams: all-gathers (and
prefetches) on one lane, gradient copies into reduce buckets on another, reduce-scatters and
reduces on a third. Their ordering rests on events and on the caching allocator's stream
bookkeeping. A missing wait shows up as a kernel reading a buffer before the collective filled it,
or a collective reading a bucket slot the copy lane has not written yet, or a new write into a
buffer a collective still reads. Those are DeepSpeed's known gaps in this area: stream races in
the reduce buckets (double-buffered buckets flipping while a reduce still reads the other one, a
receive temporary's block reused before the reduce lane is done) and in prefetch (a prefetched
group used before its gather landed, a reused gather buffer overwritten while still read).

Each test trains the same model twice in one process, on the same data, from the same
initialization:

* overlapped: the configuration as is;
* serialized: all four debug syncs on (``compile.sync_before_reduce``, ``sync_after_reduce``,
  ``sync_before_allgather``, ``sync_after_allgather``): a full device synchronize before and after
  every ``reduce_grad`` and every ``allgather_param``. A gradient's copy into its bucket, and the
  flush (reduce) it may trigger, complete before the next kernel is queued, and every gathered
  parameter (prefetched or not) has landed before any kernel that reads it is queued. A fused
  prefetch still travels while the preceding layer computes, but its buffers are complete at
  their first use either way.

Syncs change only the order in which independent work runs, never the arithmetic: with correct
stream ordering both runs compute bit for bit the same losses and final parameters. A race makes
the overlapped run read stale or half-written data, so the runs differ; the test then reports the
first differing micro-step and the parameters that differ. Both runs must also match
single-process training (Inductor tolerance of ``test_zero3_parity.py``), which catches errors the
two runs would share.

The configuration maximizes the hazards: a tiny ``reduce_bucket_size`` (4 x width elements, so
buckets fill, flush and flip constantly, grow for every large gradient, and small gradients share
slots), gradient accumulation 2 (the second micro-step accumulates through receive temporaries),
and for ZeRO-3 prefetch with one fused group per layer-sized chunk (many groups, each launched
while the previous one computes), partitioned and persistent parameters mixed. Inductor runs the
graphs; its autotuning is made deterministic where available so only the runtime can differ.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _harness import multiproc
from _harness.multiproc import run_distributed, single_world_size
from _harness.parity_cases import RunResult, assert_parity, global_grad_norm, make_optimizer
from test_zero3_parity import FP32_TOL, INDUCTOR_TOL

WORLD = single_world_size()  # 2 (or DC_TEST_WORLD_SIZES), at most the GPU count
pytestmark = pytest.mark.world_size(WORLD)  # the world size in every test id (conftest.py)

# width: model width; ffn: hidden width of each block's MLP; depth: blocks; batch: rows per rank.
GPU_SIZES = dict(width=1024, ffn=2048, depth=4, batch=64)
CPU_SIZES = dict(width=32, ffn=64, depth=2, batch=4)
GPU_MICRO_STEPS = 40  # 20 optimizer steps at gradient accumulation 2
CPU_MICRO_STEPS = 6
GAS = 2
SYNC_KEYS = ("sync_before_reduce", "sync_after_reduce", "sync_before_allgather", "sync_after_allgather")

cpu_only = pytest.mark.skipif(
    multiproc.test_device_type() == "cuda", reason="CPU smoke variant; the gpu variant runs under DC_TEST_DEVICE=cuda"
)


# ---- model and data -----------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int, ffn: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, ffn)
        self.fc2 = nn.Linear(ffn, width)

    def forward(self, h):
        return h + self.fc2(nn.functional.gelu(self.fc1(self.norm(h))))


class StressNet(nn.Module):
    """Residual MLP blocks: large weights next to small LayerNorm parameters and biases."""

    def __init__(self, width: int, ffn: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, ffn) for _ in range(depth))
        self.head = nn.Linear(width, width)

    def forward(self, x, y):
        h = x
        for block in self.blocks:
            h = block(h)
        return ((self.head(h) - y) ** 2).mean()


def build_model(sizes: dict, device) -> StressNet:
    torch.manual_seed(4321)
    return StressNet(sizes["width"], sizes["ffn"], sizes["depth"]).to(device)


def global_batch(step: int, sizes: dict, world: int, device):
    g = torch.Generator().manual_seed(30_000 + step)
    rows = sizes["batch"] * world
    x = torch.randn(rows, sizes["width"], generator=g)
    y = torch.randn(rows, sizes["width"], generator=g)
    return x.to(device), y.to(device)


def stress_config(stage: int, sizes: dict, serialized: bool) -> dict:
    width, ffn = sizes["width"], sizes["ffn"]
    zero = {"stage": stage, "reduce_bucket_size": 4 * width}
    compile_cfg = {key: serialized for key in SYNC_KEYS}
    if stage == 3:
        # LayerNorm parameters and fc2/head biases (width elements) stay gathered; the weights and
        # fc1's bias are gathered and released every use.
        zero["stage3_param_persistence_threshold"] = width
        # About one block's first half (norm + fc1) per fused group: many groups, several
        # parameters in most of them.
        zero["stage3_prefetch_bucket_size"] = width * ffn + ffn + 2 * width
        # Prefetch in force from optimizer step 1 (step 0 is profiled to plan it); selective
        # unsharding off, or the memory budget would keep every parameter gathered and nothing
        # would be prefetched.
        compile_cfg.update(prefetch=True, selective_gather=False, warmup_steps=1)
    return {"zero_optimization": zero, "compile": compile_cfg, "gradient_accumulation_steps": GAS}


@contextlib.contextmanager
def deterministic_inductor():
    """Inductor's on-device autotuning picks kernel configs by timing, which the syncs perturb and
    which can change summation order; its deterministic mode (where this torch has it) skips that."""
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, "deterministic"):
        with inductor_config.patch(deterministic=True):
            yield
    else:
        yield


# ---- training -----------------------------------------------------------------------------------


def train_engine(ctx, sizes: dict, config: dict, backend: str, steps: int):
    """Train through deepcompile on this rank's slice of every global batch; returns
    (RunResult with the mean loss over ranks per micro-step, prefetch groups planned)."""
    import deepcompile

    torch._dynamo.reset()
    model = build_model(sizes, ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), config)
    engine.compile(backend=backend)
    rows = sizes["batch"]
    lo, hi = ctx.rank * rows, (ctx.rank + 1) * rows
    losses: List[float] = []
    norms: List[float] = []
    for step in range(steps):
        x, y = global_batch(step, sizes, ctx.world_size, ctx.device)
        loss = engine(x[lo:hi], y[lo:hi])
        engine.backward(loss)
        norm = engine.step()
        if norm is not None:  # an optimizer step: the global gradient norm before clipping
            norms.append(norm.item())
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
    assert engine.micro_steps == steps
    state = {k: v.float() for k, v in engine.full_state_dict(all_ranks=True).items()}
    groups = prefetch_groups_ahead(engine) if config["zero_optimization"]["stage"] == 3 else None
    engine.destroy()
    return RunResult(losses, state, norms), groups


def prefetch_groups_ahead(engine) -> int:
    """Prefetch groups the last schedule switch planned ahead of their use, over every graph, read
    from ``engine.schedule_report()`` (as tests/scheduling/test_scheduling.py reads it). A report without a
    switch, or without a prefetch plan for any graph, fails here: the stress must not pass
    quietly with nothing prefetched."""
    report = engine.schedule_report()
    assert report.get("graphs"), f"no schedule switch reported, so no prefetch plan to count: {dict(report)}"
    plans = [g["prefetch"] for g in report["graphs"] if g["prefetch"] is not None]
    assert plans, f"the switch at step {report.get('step')} planned no prefetch for any graph: {report['graphs']}"
    return sum(1 for plan in plans for group in plan if group["ahead"])


def train_reference(sizes: dict, steps: int, world: int, device) -> RunResult:
    """Single process, plain torch, whole global batches, same initialization and data."""
    model = build_model(sizes, device)
    optimizer = make_optimizer(model.parameters())
    losses, norms = [], []
    for step in range(steps):
        x, y = global_batch(step, sizes, world, device)
        loss = model(x, y)
        (loss / GAS).backward()
        losses.append(loss.item())
        if (step + 1) % GAS == 0:
            norms.append(global_grad_norm(model.parameters()))
            optimizer.step()
            optimizer.zero_grad()
    return RunResult(losses, {k: v.detach().float().cpu() for k, v in model.state_dict().items()}, norms)


def assert_bitwise_equal(overlapped: RunResult, serialized: RunResult, what: str) -> None:
    finite = all(v == v and abs(v) != float("inf") for v in overlapped.losses + serialized.losses)
    assert finite, f"{what}: non-finite loss\noverlapped: {overlapped.losses}\nserialized: {serialized.losses}"
    if overlapped.losses != serialized.losses:
        first = next(i for i, (a, b) in enumerate(zip(overlapped.losses, serialized.losses)) if a != b)
        raise AssertionError(
            f"{what}: the overlapped run's loss differs from the serialized run's first at micro-step {first} "
            f"({overlapped.losses[first]!r} vs {serialized.losses[first]!r}): a stream race\n"
            f"overlapped: {overlapped.losses}\nserialized: {serialized.losses}")
    assert overlapped.grad_norms == serialized.grad_norms, \
        f"{what}: gradient norms differ\noverlapped: {overlapped.grad_norms}\nserialized: {serialized.grad_norms}"
    assert set(overlapped.params) == set(serialized.params), (sorted(overlapped.params), sorted(serialized.params))
    differing = []
    for key in sorted(overlapped.params):
        a, b = overlapped.params[key], serialized.params[key]
        if not torch.equal(a, b):
            diff = (a - b).abs()
            differing.append(f"{key}: {int((a != b).sum())} of {a.numel()} elements differ, max |diff| "
                             f"{diff.max().item():.3e}")
    assert not differing, (f"{what}: final parameters of the overlapped and the serialized run differ "
                           "(losses were identical):\n" + "\n".join(differing))


def offload_config(sizes: dict) -> dict:
    """Optimizer-state offload with a ZeRO-3 step streamed one block's fc1 weight per sub-group:
    reloads, steps and write-backs of neighbouring sub-groups in flight on three streams."""
    return {"offload_optimizer": {"device": "cpu", "pin_memory": True}, "sub_group_size": sizes["width"] * sizes["ffn"]}


def with_offload(config: dict, sizes: dict, offload: str) -> dict:
    """``offload``: "opt_states" (offload_config) or "all": also every master shard on the host
    (gathered from there on the runtime's lanes) and activation offload with free_activation, as
    the joint plan places it (the first step's window offloads every candidate provisionally)."""
    config["zero_optimization"].update(offload_config(sizes))
    if offload == "all":
        config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
        config.setdefault("compile", {}).update(offload_activation=True, free_activation=True)
    return config


def _stress_body(ctx, stage: int, sizes: dict, backend: str, steps: int, min_prefetch_groups: int,
                 offload: str = ""):
    runs: Dict[str, RunResult] = {}
    groups: Dict[str, Optional[int]] = {}
    with deterministic_inductor():
        for mode in ("overlapped", "serialized"):
            config = stress_config(stage, sizes, serialized=mode == "serialized")
            if offload and mode == "overlapped":
                # Compared with the serialized run *without* offload: offload must move bytes only,
                # and its copies must be ordered against the step and the next forward.
                config = with_offload(config, sizes, offload)
            runs[mode], groups[mode] = train_engine(ctx, sizes, config, backend, steps)
    what = f"ZeRO-{stage} ({backend}, rank {ctx.rank})"
    assert_bitwise_equal(runs["overlapped"], runs["serialized"], what)
    if stage == 3:
        for mode, n in groups.items():
            assert n >= min_prefetch_groups, (
                f"{what}, {mode}: only {n} prefetch groups planned ahead of their use; the stress needs "
                f"at least {min_prefetch_groups}")
    ref = train_reference(sizes, steps, ctx.world_size, ctx.device)
    tol = INDUCTOR_TOL if backend == "inductor" else FP32_TOL
    for mode, run in runs.items():
        assert_parity(run, ref, **tol)


@pytest.mark.gpu
def test_zero3_overlapped_equals_serialized():
    """ZeRO-3, Inductor, prefetch from optimizer step 1 (about two fused groups per block, each
    launched while the previous one computes), reduce buckets of 4096 elements, gradient
    accumulation 2, 40 micro-steps (20 optimizer steps), 4 residual blocks of width 1024.

    Asserts: the overlapped and the serialized (all four debug syncs) run give bitwise-identical
    per-micro-step losses and ``full_state_dict()``; at least 8 prefetch groups were planned ahead
    of their use; both runs match single-process training within rtol 1e-4 / atol 1e-5.
    """
    run_distributed(_stress_body, WORLD, args=(3, GPU_SIZES, "inductor", GPU_MICRO_STEPS, 8), timeout=600)


@pytest.mark.gpu
def test_zero2_overlapped_equals_serialized():
    """ZeRO-2, Inductor, reduce buckets of 4096 elements, gradient accumulation 2 (each micro-step
    reduces into the owners' partitions; the second one accumulates), 40 micro-steps.

    Asserts bitwise-identical losses and ``full_state_dict()`` between the overlapped and the
    serialized run, and parity of both with single-process training (rtol 1e-4 / atol 1e-5).
    """
    run_distributed(_stress_body, WORLD, args=(2, GPU_SIZES, "inductor", GPU_MICRO_STEPS, 0), timeout=600)


@pytest.mark.gpu
def test_zero3_overlapped_with_offload_equals_serialized():
    """As test_zero3_overlapped_equals_serialized, with optimizer-state offload streaming the step
    in the overlapped run only: bitwise the serialized run without offload."""
    run_distributed(_stress_body, WORLD, args=(3, GPU_SIZES, "inductor", GPU_MICRO_STEPS, 8),
                    kwargs={"offload": "opt_states"}, timeout=600)


@pytest.mark.gpu
def test_zero3_overlapped_with_every_offload_kind_equals_serialized():
    """As above with parameter and activation offload on too (masters gathered from the host,
    activations copied out in the forward and back in the backward): bitwise the serialized run
    without offload."""
    run_distributed(_stress_body, WORLD, args=(3, GPU_SIZES, "inductor", GPU_MICRO_STEPS, 8),
                    kwargs={"offload": "all"}, timeout=600)


@cpu_only
@pytest.mark.parametrize("stage,offload", [(2, ""), (3, ""), (3, "opt_states"), (3, "all")])
def test_overlapped_equals_serialized_cpu_smoke(stage, offload):
    run_distributed(_stress_body, WORLD, args=(stage, CPU_SIZES, "inductor", CPU_MICRO_STEPS, 4),
                    kwargs={"offload": offload}, timeout=600)
