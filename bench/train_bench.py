"""Training throughput and memory of deepcompile ZeRO-1/2/3 against FSDP2 and DDP, in one table.

    torchrun --nproc-per-node 2 bench/train_bench.py [--preset tiny|8b] [--methods z3,z1,...]
                                                     [--warmup 5] [--steps 10] [--markdown PATH]

Every method trains the same randomly initialised ``transformers.LlamaForCausalLM``
(attn_implementation="sdpa") on random token ids (labels = input ids), with AdamW, one method after
the other in this process. Per method: build a fresh model with the same seed, run the warm-up
steps (the first one compiles), time the measured steps, then tear everything down (engine,
model, optimizer, Dynamo caches, CUDA cache) so the next method starts from a clean device.

The rows and how each one keeps its weights:

* ``deepcompile ZeRO-3`` / ``ZeRO-1`` / ``ZeRO-2``: bf16 model on the device, ``bf16.enabled``;
  the engine keeps the fp32 master weights (and Adam state) partitioned over the ranks.
* ``FSDP2 + compile``: the usual FSDP2 recipe. The model stays fp32 (the sharded parameters are
  the fp32 master weights); ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` casts
  what is gathered for compute and reduces gradients in fp32. ``fully_shard`` on every decoder
  layer and on the root, then ``torch.compile(model)``.
* ``DDP + compile``: *not* DDP over a bf16 model. A bf16 DDP model would run AdamW on bf16
  weights (no fp32 master copy at all), which is a different, less accurate training recipe and
  not comparable with the others. Instead the model is fp32 (weights, gradients, all-reduce and
  Adam state in fp32, replicated) and the forward runs under ``torch.autocast(bfloat16)``, the
  standard mixed-precision DDP recipe. Then ``torch.compile`` of the DDP module (DDPOptimizer
  splits the graph at bucket boundaries).
* ``deepcompile ZeRO-3`` is plain gather-before-use insertion (both optional passes off);
  ``deepcompile ZeRO-3 + prefetch`` (key ``z3-prefetch``) adds the profile-guided prefetch pass and
  ``deepcompile ZeRO-3 + prefetch + selective`` (key ``z3-auto``) also selective unsharding, both
  with ``compile.warmup_steps`` 1: step 0 runs plain and is profiled, step 1 runs the plan and is
  profiled once more to measure it, step 2 compiles the planned graphs, so ``--warmup`` must be at
  least 3 for them.
  ``--memory-budget-gib`` sets ``compile.memory_budget_bytes`` (default: 90 % of the device).

Columns (all per rank; time and memory are the maximum over ranks, the loss their mean):

* step time: median over the measured steps of the wall time of forward + backward + optimizer
  step, bracketed by ``torch.cuda.synchronize()``.
* tokens/s/GPU: micro_batch * seq / step time.
* TFLOP/s/GPU: model FLOPs, flops_per_token * micro_batch * seq / step time, with
  flops_per_token = 6 * N_params + 12 * n_layers * hidden * seq (N_params counts all parameters,
  embeddings and LM head included; recomputation is not counted).
* peak mem: ``torch.cuda.max_memory_allocated`` over the measured steps (``reset_peak_memory_stats``
  after the warm-up): the steady-state peak of training, without one-off warm-up costs such as
  compilation or deepcompile's profiling step (which runs the graphs un-fused once). "n/a" on CPU.
* first step: wall time of the first step, which includes Dynamo tracing and backend compilation.
* first scheduled step: from the start of the first step to the end of the first step that ran the
  method's final plan compiled (profile-guided rows: profiled step 0, re-plan, profiled step 1,
  step 2 compiled with the plan; other rows: the first step), and its ratio to FSDP2 + compile's
  first step of the same run; ``--warm-start`` adds the same time for a restart on warm caches.
  ``--compile-cache cold`` gives every row an empty cache directory (a user's first start).
* loss: the loss of the last measured step (a sanity check that every method trains the same
  model; on random tokens it stays near ln(vocab)).

A method that does not fit prints "OOM" (out-of-memory is caught per method; it is expected to hit
all ranks alike, since every rank runs the same shapes). Any other failure prints "error" with the
exception, and the next method still runs.

Devices: with CUDA, NCCL and one GPU per rank (cuda:LOCAL_RANK), backend "inductor" by default;
without, gloo on CPU and backend "eager" by default (quick smoke runs: ``--preset tiny``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `import deepcompile` must be this checkout (the one being benchmarked), not another installed copy.
sys.path.insert(0, REPO_ROOT)

import deepcompile  # noqa: E402
from dist_setup import setup  # noqa: E402

FSDP2_NAME = "FSDP2 + compile"  # the peer the compile-time ratio is taken against
GIB = 1024**3
COMPILE_CACHES = ("cold", "shared", "off")

# ------------------------------------------------------------------------------------- options

PRESETS: Dict[str, Dict[str, int]] = {
    # 8B-class (Llama-3-8B shapes). Probably does not fit for every method; OOM is reported per row.
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    # CPU smoke runs. Small deepcompile thresholds so that even this model has gathered (not
    # persistent) ZeRO-3 parameters and several reduce buckets, as the large models do.
    "tiny": dict(hidden=64, layers=2, heads=4, intermediate=172, vocab=256, seq=64, micro_batch=2,
                 persistence_threshold=1_000, reduce_bucket_size=20_000),
}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="model/batch preset: its values replace the defaults; options given explicitly still win")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma list of {', '.join(METHODS)} (default: {','.join(DEFAULT_METHODS)}), or 'all'")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps, the first (compiling) one included; >= 1")
    p.add_argument("--steps", type=int, default=10, help="measured steps")
    p.add_argument("--backend", choices=["inductor", "eager"], default=None,
                   help="compiler backend of deepcompile and torch.compile (default: inductor on CUDA, eager on CPU)")
    p.add_argument("--reduce-bucket-size", type=float, default=5e7,
                   help="deepcompile zero_optimization.reduce_bucket_size in elements (default 5e7, about one "
                        "decoder layer of the default model; the library default 5e8 allocates two 500M-element "
                        "buckets up front and leaves a 1B model a single bucket, i.e. no overlap)")
    p.add_argument("--persistence-threshold", type=float, default=1e5,
                   help="deepcompile zero_optimization.stage3_param_persistence_threshold (elements)")
    p.add_argument("--memory-budget-gib", type=float, default=None,
                   help="deepcompile ZeRO-3 compile.memory_budget_bytes in GiB for the profile-guided passes "
                        "(default: compile.memory_budget_fraction of the device)")
    p.add_argument("--sub-group-size", type=float, default=None,
                   help="deepcompile ZeRO-3 zero_optimization.sub_group_size in elements (default: the library's, "
                        "DeepSpeed's 1e9): the optimizer step updates at most this many master elements at a time")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile-cache", choices=COMPILE_CACHES, default="shared",
                   help="compile caches of each row: 'cold' (a fresh, empty Inductor/Triton cache directory and "
                        "cleared in-memory caches per row: a user's first start), 'shared' (default: the caches "
                        "of this machine; a row may reuse what an earlier row or run compiled), 'off' (caches "
                        "disabled: every graph compiled from scratch, not even reused within the row)")
    p.add_argument("--cold-compile", action="store_true", help="same as --compile-cache off (older name)")
    p.add_argument("--warm-start", action="store_true",
                   help="after each row, start the method once more on the caches the row left (a restart: "
                        "fresh model, Dynamo and in-memory caches reset) and report its time to the first "
                        "scheduled step too")
    p.add_argument("--markdown", metavar="PATH", help="also append the table as Markdown to PATH")
    p.add_argument("--trace", metavar="DIR", help="after the measured steps, profile --trace-steps more with "
                   "torch.profiler and write a text summary per method to DIR/<method>.txt (rank 0)")
    p.add_argument("--trace-steps", type=int, default=2)
    preset = p.parse_known_args(argv)[0].preset
    if preset:
        p.set_defaults(**PRESETS[preset])
    args = p.parse_args(argv)
    if args.kv_heads is None:
        args.kv_heads = args.heads
    if args.cold_compile:
        args.compile_cache = "off"
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the first step compiles and is never measured)")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.warmup < 3 and any(m in args.methods for m in ("z3-prefetch", "z3-auto", "all")):
        p.error("--warmup must be >= 3 with z3-prefetch / z3-auto (profile at step 0, re-plan at step 1)")
    keys = list(METHODS) if args.methods.strip() == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [k for k in keys if k not in METHODS]
    if unknown or not keys:
        p.error(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    args.methods = keys
    args.reduce_bucket_size = int(args.reduce_bucket_size)
    args.persistence_threshold = int(args.persistence_threshold)
    return args


# ------------------------------------------------------------------------------------- context


@dataclasses.dataclass
class Context:
    """What every method needs: the run's options, the device and the pre-generated batches."""

    args: argparse.Namespace
    device: torch.device
    backend: str
    rank: int
    world: int
    batches: List[torch.Tensor]  # (micro_batch, seq) token ids, one per step, this rank's slice
    n_params: int  # parameters of the model, for the FLOP count

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def model_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq, attn_implementation="sdpa",
        use_cache=False,  # training: no KV cache objects in the traced graph
    )


def count_params(args: argparse.Namespace) -> int:
    """Parameters of the model (tied ones once), counted on the meta device: no memory, no init."""
    with torch.device("meta"):
        model = LlamaForCausalLM(model_config(args))
    return sum(p.numel() for p in model.parameters())


def flops_per_token(args: argparse.Namespace, n_params: int) -> float:
    return 6 * n_params + 12 * args.layers * args.hidden * args.seq


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(ctx: Context, dtype: torch.dtype) -> torch.nn.Module:
    """A fresh model, built directly on the device in ``dtype`` (no fp32 copy first, so the peak
    memory of a bf16 method is not inflated by construction), identical on every rank."""
    torch.manual_seed(ctx.args.seed)
    with torch.device(ctx.device), default_dtype(dtype):
        model = LlamaForCausalLM(model_config(ctx.args))
    # Same seed gives the same weights on every rank already; the broadcast makes it a guarantee
    # (FSDP2 and deepcompile ZeRO-3 shard whatever each rank holds).
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    model.train()
    return model


def make_optimizer(ctx: Context, params) -> torch.optim.Optimizer:
    # The same optimizer (torch's default implementation for the device) for every method.
    return torch.optim.AdamW(params, lr=ctx.args.lr)


def make_batches(args: argparse.Namespace, rank: int, device: torch.device) -> List[torch.Tensor]:
    """Random token ids, different per rank and step, identical for every method."""
    out = []
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
        out.append(torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g).to(device))
    return out


# ------------------------------------------------------------------------------------- methods


class Unavailable(Exception):
    """A method that cannot run in this build or on this device; the message is the reason."""


@dataclasses.dataclass
class Runner:
    """One method, set up: ``step(tokens)`` runs forward + backward + optimizer step and returns
    the loss (not synchronised); ``note()`` says anything worth a note after the run; ``close()``
    releases what only an explicit call can release."""

    step: Callable[[torch.Tensor], torch.Tensor]
    close: Callable[[], None] = lambda: None
    note: Callable[[], str] = lambda: ""
    # True once the step just run was a step of the method's final plan, run compiled (not
    # profiled): the profile-guided ZeRO-3 rows profile, re-plan and recompile first.
    scheduled: Callable[[], bool] = lambda: True


def deepcompile_runner(ctx: Context, stage: int, passes: Tuple[str, ...] = ()) -> Runner:
    model = build_model(ctx, torch.bfloat16)  # deepcompile needs the bf16 model on the device
    optimizer = make_optimizer(ctx, model.parameters())  # re-targeted at the fp32 master shards
    config = {
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": ctx.args.reduce_bucket_size,
            "stage3_param_persistence_threshold": ctx.args.persistence_threshold,
        },
        "bf16": {"enabled": True},
        "train_micro_batch_size_per_gpu": ctx.args.micro_batch,
        "compile": {
            "prefetch": "prefetch" in passes,
            "selective_gather": "selective_gather" in passes,
            "warmup_steps": 1,  # profile step 0, plan after it
        },
    }
    if ctx.args.memory_budget_gib is not None:
        config["compile"]["memory_budget_bytes"] = int(ctx.args.memory_budget_gib * 2**30)
    if ctx.args.sub_group_size is not None and stage == 3:
        config["zero_optimization"]["sub_group_size"] = int(ctx.args.sub_group_size)
    try:
        engine = deepcompile.initialize(model, optimizer, config)
    except BaseException:
        deepcompile.runtime.cleanup()  # initialize may fail after creating the runtime
        raise
    engine.compile(backend=ctx.backend)

    final = engine.scheduler.schedule.entry_at(1 << 62)  # the plan in force once every entry applied
    last = {"scheduled": False}

    def step(tokens: torch.Tensor) -> torch.Tensor:
        planned = engine.scheduler.applied == final
        loss = engine(input_ids=tokens, labels=tokens).loss
        profiled = engine.scheduler.mode is not None  # this micro-step runs through the profiler
        engine.backward(loss)
        engine.step()
        last["scheduled"] = planned and not profiled
        return loss

    def note() -> str:
        # ZeRO-3 parameters used outside the compiled graphs (graph breaks) are gathered by
        # module hooks, unscheduled: correct but slower. Say so rather than hide it in the time.
        eager = engine.eagerly_gathered_params() if stage == 3 else []
        return f"{len(eager)} parameters gathered eagerly (graph breaks)" if eager else ""

    return Runner(step, close=engine.destroy, note=note, scheduled=lambda: last["scheduled"])


def torch_training_runner(compiled, optimizer, autocast_device: Optional[str] = None) -> Runner:
    """The plain PyTorch step shared by the peers (FSDP2, DDP); bf16 autocast when asked."""

    def step(tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast(autocast_device or "cpu", dtype=torch.bfloat16, enabled=autocast_device is not None):
            loss = compiled(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return Runner(step)


def fsdp2_runner(ctx: Context) -> Runner:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(ctx, torch.float32)  # fp32 shards are the master weights
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # root: embeddings, final norm, LM head
    optimizer = make_optimizer(ctx, model.parameters())  # DTensor shards
    return torch_training_runner(torch.compile(model, backend=ctx.backend), optimizer)


def ddp_runner(ctx: Context) -> Runner:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(ctx, torch.float32)  # fp32 weights + autocast: see the module docstring
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.is_cuda else None)
    optimizer = make_optimizer(ctx, ddp.parameters())
    return torch_training_runner(torch.compile(ddp, backend=ctx.backend), optimizer,
                                 autocast_device=ctx.device.type)


@dataclasses.dataclass(frozen=True)
class Method:
    name: str  # the row label
    build: Callable[[Context], Runner]
    key: str = ""  # the --methods key (filled in below)


# The rows; the keys are what --methods takes (the table follows the order given there; 'all' is this order).
METHODS: Dict[str, Method] = {
    "z3": Method("deepcompile ZeRO-3", lambda ctx: deepcompile_runner(ctx, stage=3)),
    "z3-prefetch": Method("deepcompile ZeRO-3 + prefetch",
                          lambda ctx: deepcompile_runner(ctx, stage=3, passes=("prefetch",))),
    "z3-auto": Method("deepcompile ZeRO-3 + prefetch + selective",
                      lambda ctx: deepcompile_runner(ctx, stage=3, passes=("prefetch", "selective_gather"))),
    "z1": Method("deepcompile ZeRO-1", lambda ctx: deepcompile_runner(ctx, stage=1)),
    "z2": Method("deepcompile ZeRO-2", lambda ctx: deepcompile_runner(ctx, stage=2)),
    "fsdp2": Method(FSDP2_NAME, fsdp2_runner),
    "ddp": Method("DDP + compile", ddp_runner),
}
METHODS = {key: dataclasses.replace(m, key=key) for key, m in METHODS.items()}
DEFAULT_METHODS = ["z3", "z3-prefetch", "z3-auto", "z1", "z2", "fsdp2", "ddp"]


# ------------------------------------------------------------------------------------- measuring


@dataclasses.dataclass
class Row:
    """One table row. ``status`` is "ok", "n/a", "OOM" or "error"; numbers are set only when ok."""

    method: str
    status: str = "ok"
    note: str = ""
    step_ms: Optional[float] = None
    tokens_per_s: Optional[float] = None
    tflops: Optional[float] = None
    peak_gib: Optional[float] = None
    compile_s: Optional[float] = None
    scheduled_s: Optional[float] = None  # time to the end of the first scheduled step
    vs_fsdp2: Optional[float] = None  # scheduled_s / FSDP2 + compile's first step, same run
    warm_scheduled_s: Optional[float] = None  # --warm-start: the same, restarted on warm caches
    loss: Optional[float] = None


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


def sync(ctx: Context) -> None:
    if ctx.is_cuda:
        torch.cuda.synchronize(ctx.device)


def teardown(ctx: Context) -> None:
    """Leave nothing of the previous method behind: compiled code, cached blocks, garbage."""
    gc.collect()
    torch._dynamo.reset()
    gc.collect()
    if ctx.is_cuda:
        torch.cuda.synchronize(ctx.device)
        torch.cuda.empty_cache()
    dist.barrier()


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
        if ctx.args.trace:
            from step_trace import trace_steps

            trace_steps(runner.step, ctx.batches[: ctx.args.trace_steps], lambda: sync(ctx),
                        os.path.join(ctx.args.trace, f"{method.key}.txt"), method.name, write=ctx.rank == 0)
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
    row = Row(method.name, note=per_rank[0].note)
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
    return row


def _max_or_none(values: List[Optional[float]]) -> Optional[float]:
    return None if any(v is None for v in values) else max(values)


def compare_with_fsdp2(rows: List[Row]) -> None:
    """Fill ``vs_fsdp2``: each row's time to its first scheduled step over FSDP2 + compile's
    first step in this run (left empty without an FSDP2 row)."""
    fsdp2 = next((r for r in rows if r.method == FSDP2_NAME and r.status == "ok"), None)
    if fsdp2 is None or not fsdp2.compile_s:
        return
    for r in rows:
        if r.status == "ok" and r.scheduled_s is not None:
            r.vs_fsdp2 = r.scheduled_s / fsdp2.compile_s


# ------------------------------------------------------------------------------------- output

COLUMNS = ["method", "step time (ms)", "tokens/s/GPU", "TFLOP/s/GPU", "peak mem (GiB)", "first step (s)",
           "first scheduled step (s)", "÷ FSDP2 first step", "warm: first scheduled step (s)", "loss", "note"]


def cells(row: Row) -> List[str]:
    def num(value: Optional[float], fmt: str) -> str:
        if row.status != "ok":
            return row.status  # "n/a", "OOM" or "error" in every number column
        if value is None:
            return "n/a"
        # Tiny smoke-run models would print 0.0; keep three significant digits there.
        return format(value, fmt) if abs(value) >= 1 or value == 0 else format(value, ".3g")

    return [row.method, num(row.step_ms, ".1f"), num(row.tokens_per_s, ",.0f"), num(row.tflops, ".1f"),
            num(row.peak_gib, ".2f"), num(row.compile_s, ".1f"), num(row.scheduled_s, ".1f"),
            num(row.vs_fsdp2, ".2f"), num(row.warm_scheduled_s, ".1f"), num(row.loss, ".4f"), row.note]


def text_table(rows: List[Row]) -> str:
    body = [COLUMNS] + [cells(r) for r in rows]
    widths = [max(len(line[i]) for line in body) for i in range(len(COLUMNS))]
    fmt = lambda line: "  ".join(c.ljust(w) if i in (0, len(line) - 1) else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(line, widths))).rstrip()
    rule = "-" * len(fmt(COLUMNS))
    return "\n".join([fmt(COLUMNS), rule] + [fmt(line) for line in body[1:]])


def markdown_table(rows: List[Row]) -> str:
    esc = lambda s: s.replace("|", "\\|")
    lines = ["| " + " | ".join(COLUMNS) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(COLUMNS) - 2) + ["---"]) + " |"]
    lines += ["| " + " | ".join(esc(c) for c in cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO_ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev + (" (modified)" if dirty else "")) if rev else "unknown"
    except Exception:
        return "unknown"


def source_digest() -> str:
    """scripts/source_digest.sh: names the tree that ran even where the git metadata is stale."""
    try:
        out = subprocess.run(["bash", os.path.join(REPO_ROOT, "scripts", "source_digest.sh")], capture_output=True,
                             text=True, timeout=30).stdout.strip()
        return out or "unknown"
    except Exception:
        return "unknown"


def environment(ctx: Context) -> Dict[str, str]:
    a = ctx.args
    if ctx.is_cuda:
        device = torch.cuda.get_device_name(ctx.device)
        version = torch.cuda.nccl.version()  # a tuple in recent torch, an int in old ones
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    else:
        device, nccl = "CPU", "n/a (gloo)"
    return {
        "command": "torchrun --nproc-per-node {} {}".format(ctx.world, shlex.join(sys.argv)),
        "date (UTC)": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "device": f"{ctx.world} x {device}",
        "world size": str(ctx.world),
        "torch": torch.__version__ + (f", CUDA {torch.version.cuda}" if ctx.is_cuda else ""),
        "NCCL": nccl,
        "deepcompile commit": git_revision(),
        "source digest": source_digest(),
        "model": (f"Llama hidden {a.hidden}, layers {a.layers}, heads {a.heads} (kv {a.kv_heads}), "
                  f"intermediate {a.intermediate}, vocab {a.vocab}; {ctx.n_params / 1e6:,.1f} M parameters"),
        "batch": f"micro-batch {a.micro_batch} x seq {a.seq} per rank",
        "steps": f"{a.warmup} warm-up (first compiles) + {a.steps} measured; backend {ctx.backend}",
        "compile caches": {
            "cold": "cold (each row starts on an empty cache directory, in-memory caches cleared)",
            "shared": "shared (a row may reuse earlier compiles of this machine)",
            "off": "off (caches disabled)",
        }[a.compile_cache] + ("; warm restart per row" if a.warm_start else ""),
        "deepcompile": (f"reduce_bucket_size {a.reduce_bucket_size:,}, "
                        f"stage3_param_persistence_threshold {a.persistence_threshold:,}"),
        "FLOPs/token": f"{flops_per_token(a, ctx.n_params) / 1e9:.3f} G (6 N + 12 L H S)",
    }


def append_markdown(path: str, env: Dict[str, str], rows: List[Row]) -> None:
    lines = [f"## {env['date (UTC)']} UTC, {env['device']}", ""]
    lines += [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in env.items()]
    lines += ["", markdown_table(rows), ""]
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        if new:
            f.write("# Benchmark results (bench/train_bench.py)\n\n")
        f.write("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------- main


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    device, rank, world = setup()
    backend = args.backend or ("inductor" if device.type == "cuda" else "eager")
    if args.compile_cache == "off":
        # Also keeps artifacts of older builds out (NOTES.md: cached graphs and dc op registrations).
        import torch._inductor.config as inductor_config

        inductor_config.force_disable_caches = True
    ctx = Context(args, device, backend, rank, world, make_batches(args, rank, device), count_params(args))
    env = environment(ctx)
    if rank == 0:
        print("\n".join(f"{k}: {v}" for k, v in env.items()), flush=True)

    rows = []
    for key in args.methods:
        method = METHODS[key]
        if rank == 0:
            print(f"== {method.name}", flush=True)
        mine = measure(ctx, method)
        everyone: List[Optional[RankMeasurement]] = [None] * world
        dist.all_gather_object(everyone, mine)
        row = combine(ctx, method, everyone)
        rows.append(row)
        if rank == 0:
            summary = (", ".join(f"{c}: {v}" for c, v in zip(COLUMNS[1:-1], cells(row)[1:-1])) if row.status == "ok"
                       else f"{row.status}: {row.note}")
            print("  " + summary, flush=True)

    compare_with_fsdp2(rows)
    if rank == 0:
        print("\n" + text_table(rows), flush=True)
        if args.markdown:
            append_markdown(args.markdown, env, rows)
            print(f"\nappended to {args.markdown}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
