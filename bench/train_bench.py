"""Training throughput and memory of deepcompile ZeRO-1/2/3 against FSDP2 and DDP, in one table.

    torchrun --nproc-per-node 2 bench/train_bench.py [--preset tiny|8b] [--methods z3,z1,...]
                                                     [--warmup 5] [--steps 10] [--markdown PATH]
    python3 bench/train_bench.py --preset 7b [--trace DIR]   # one GPU, offload rows, one process per row

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
* Offload (issue 18), for a model whose training state does not fit the device:
  ``z3-offload``: deepcompile ZeRO-3 with ``zero_optimization.offload_optimizer: {"device": "cpu",
  "pin_memory": true}`` (all optimizer state on the host between steps);
  ``z3-offload-budget``: ``compile.offload_opt_states`` under ``compile.memory_budget_fraction``
  (``--memory-budget-fraction``, default 0.9; ``--memory-budget-gib`` instead sets bytes): only what
  does not fit moves; ``z3-offload-all``: every offload kind planned under that budget
  (``offload_opt_states``, ``offload_activation``, ``offload_parameters``); a build whose config
  refuses one of them gives the row "unavailable: <the error>"; ``fsdp2-offload``: the peer, FSDP2
  as above plus ``CPUOffloadPolicy(pin_memory=True)`` (parameters, gradients and the AdamW step on
  the host; unpinned on a CPU smoke run). ``--offload-passes`` adds deepcompile's profile-guided passes to the offload rows.
* ``--init meta`` (the ``7b`` preset's default): every model is built on the ``meta`` device, with
  no full copy anywhere: deepcompile rows pass ``init_fn`` (transformers' ``_init_weights``) and the
  device to ``deepcompile.initialize``, which materialises and shards one module at a time; FSDP2
  rows shard on ``meta``, then ``to_empty`` (the host with CPU offload) and initialise each shard.
* ``--isolate`` (the ``7b`` preset's default) runs each row in its own ``torchrun`` child process
  (``--nproc`` ranks, ``--row-timeout`` seconds), so that host memory (FSDP2 CPU offload of a 7B
  model pins about 108 GB) and the device are clean for the next row; a row whose process dies
  (host out of memory: killed) or times out says so in its row, and the table goes on. The extra
  column "host peak" is the row process's peak resident memory (VmHWM).
* PCIe: on CUDA the run first measures pinned host-device copy bandwidth (``bench/pcie_bench.py``:
  H2D, D2H, both at once; ``--pcie-gib`` x ``--pcie-repeats``; on by default when an offload row
  runs, ``--pcie``/``--no-pcie`` to choose) and prints it in the header, so a row's transfer time can be read against the bus.
* ``--trace DIR``: after the measured steps, ``--trace-steps`` more run under ``torch.profiler``
  (``bench/step_trace.py``); from the trace every row gets the columns "transfer / hidden ms (%)"
  (H2D + D2H copy time per step and the part of it during which kernels on other streams run),
  "GB moved/step", "PCIe floor (ms)" (each direction's bytes over the bandwidth measured above, the
  larger of the two: the step time if transfers were all that ran) and "traced step (ms)".
* ``deepcompile ZeRO-3`` is plain gather-before-use insertion (both optional passes off);
  ``deepcompile ZeRO-3 + prefetch`` (key ``z3-prefetch``) adds the profile-guided prefetch pass and
  ``deepcompile ZeRO-3 + prefetch + selective`` (key ``z3-auto``) also selective unsharding, both
  with ``compile.warmup_steps`` 1: step 0 runs plain and is profiled, step 1 runs the plan and is
  profiled once more to measure it, step 2 compiles the planned graphs, so ``--warmup`` must be at
  least 3 for them. ``deepcompile ZeRO-3 + prefetch, per layer`` (key ``z3-prefetch-regional``)
  is ``z3-prefetch`` with ``engine.compile(regional=True)``: each decoder layer compiled on its own,
  identical layers sharing one compiled graph (the embedding and head run eagerly).
  ``--memory-budget-gib`` sets ``compile.memory_budget_bytes`` (default: 90 % of the device).
* Layouts (issue 30, ``bench/layouts.py``): ``--shard-group-size`` (hybrid sharding,
  ``mics_shard_size``) and ``--hpz-partition-size`` (hpZ, ZeRO-3 only) apply to every deepcompile
  row, ``--layouts plain,2x1,hpz2`` gives each deepcompile method one row per layout,
  ``--methods z3@2x1`` one row its own; such a row carries its layout in its label. Peer rows never
  change. Every deepcompile row reports the bytes per link of its last measured step
  (``engine.step_report.comm_bytes``): the column "GB/step shard/replica/secondary".

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
  model; on random tokens it stays near ln(vocab)). The JSON rows also hold ``losses``: every
  step's loss, warm-up included (mean over ranks).

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
import json
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/'s own modules

import deepspeed_peer  # noqa: E402  (DeepSpeed's rows; imports DeepSpeed only when one is built)
import layouts  # noqa: E402
import peer_rows  # noqa: E402
from dist_setup import setup  # noqa: E402

FSDP2_NAME = "FSDP2 + compile"  # the peer the compile-time ratio is taken against
FSDP2_OFFLOAD_NAME = "FSDP2 + CPU offload + compile"  # the peer of the offload rows' speed-up
GIB = 1024**3
COMPILE_CACHES = ("cold", "shared", "off")

# ------------------------------------------------------------------------------------- options

PRESETS: Dict[str, Dict[str, object]] = {
    # 8B-class (Llama-3-8B shapes). Probably does not fit for every method; OOM is reported per row.
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    # Issue 18's 7B Llama on one GPU: its training state (~108 GB) does not fit an 80 GB card, so
    # the rows are the offload ones; built on meta, one process per row.
    "7b": dict(hidden=4096, layers=32, heads=32, intermediate=11008, vocab=32000, seq=2048, micro_batch=1,
               warmup=3, steps=3, methods="fsdp2-offload,z3-offload,z3-offload-budget,z3-offload-all",
               init="meta", isolate=True, trace_steps=1, trace_memory=False, row_timeout=540, peer_repeats=1,
               sub_group_size=2e8),  # the offloaded step streams 1.6 GB of Adam state per sub-group
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
    p.add_argument("--communication-data-type", choices=["fp32", "bf16"], default=None,
                   help="deepcompile communication_data_type: gradients are reduced in this dtype and, under "
                        "ZeRO-3, their partitions kept in it (default: the library's, fp32)")
    p.add_argument("--optimizer-step-in-backward", action="store_true",
                   help="deepcompile ZeRO-3 compile.optimizer_step_in_backward: parameters step during the backward "
                        "as their gradients become final, freeing their gradient partitions (per-layer graphs: "
                        "regional compilation)")
    p.add_argument("--shard-group-size", type=int, default=-1, metavar="S",
                   help="deepcompile rows only: hybrid sharding, zero_optimization.mics_shard_size S (shard groups "
                        "of S consecutive ranks, replicated across groups; must divide the world size); -1 "
                        "(default): plain ZeRO over the world. Peer rows (FSDP2, DDP, DeepSpeed) are unchanged")
    p.add_argument("--hpz-partition-size", type=int, default=1, metavar="H",
                   help="deepcompile ZeRO-3 rows only: ZeRO++ hpZ, zero_optimization.zero_hpz_partition_size H "
                        "(a secondary copy of the parameter shards over H ranks); 1 (default): off. Refused with "
                        "ZeRO-1/2 rows; peer rows are unchanged")
    p.add_argument("--layouts", type=lambda s: [t.strip() for t in s.split(",") if t.strip()], default=None,
                   metavar="L1,L2,...",
                   help="deepcompile rows only: one row per layout for each deepcompile method, labelled with it: "
                        "plain, RxS (R replicas x shard groups of S ranks, R*S = world size; e.g. 2x1), hpzH (e.g. "
                        "hpz2, ZeRO-3 only) or RxS+hpzH. One row's layout: --methods z3@2x1 (bench/layouts.py)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--same-batch", action="store_true",
                   help="every step trains on the first step's tokens, so the loss must fall (smoke runs: a check "
                        "that training makes progress, which random tokens cannot show)")
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
    p.add_argument("--memory-history", metavar="DIR",
                   help="after the measured steps, one more step under the allocator's history only (no profiler), "
                        "written to DIR/<method key>.memory.pickle.gz for bench/memory_peak.py")
    p.add_argument("--memory-history-stacks", choices=["python", "all", "none"], default="python",
                   help="what --memory-history records with each allocation (default python)")
    p.add_argument("--trace-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="--trace also records the allocator's history with Python stacks (default on; off in the "
                        "7b preset: slow and large for a 7B step)")
    p.add_argument("--init", choices=["device", "meta"], default="device",
                   help="build each model on the device in its dtype (default) or on meta, materialised by "
                        "deepcompile.initialize(init_fn=) / FSDP2 to_empty + init (no full copy anywhere)")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=False,
                   help="run each row in its own torchrun child process (default off; on in the 7b preset)")
    p.add_argument("--nproc", type=int, default=1, help="--isolate: ranks of each row's process")
    p.add_argument("--row-timeout", type=float, default=None, help="--isolate: seconds per row (default: none)")
    p.add_argument("--memory-budget-fraction", type=float, default=0.9,
                   help="z3-offload-budget / z3-offload-all: compile.memory_budget_fraction (unless --memory-budget-gib)")
    p.add_argument("--offload-passes", choices=sorted(OFFLOAD_PASSES), default="none",
                   help="deepcompile passes of the offload rows: none (plain ZeRO-3), prefetch, auto "
                        "(prefetch + selective_gather); the last two need --warmup >= 3")
    p.add_argument("--pcie", action=argparse.BooleanOptionalAction, default=None,
                   help="measure pinned host<->device bandwidth first (CUDA only; default: when an offload row runs)")
    p.add_argument("--pcie-gib", type=float, default=1.0)
    p.add_argument("--pcie-repeats", type=int, default=5)
    p.add_argument("--json", metavar="PATH", help="also write the header and the rows as JSON to PATH")
    p.add_argument("--peer-repeats", type=int, default=2,
                   help=f"run each of the rows {', '.join(REPEATED_PEERS)} this many times, one after the other, "
                        "and report every run (their step times vary between runs; default 2, 1 in the 7b preset)")
    p.add_argument("--child-json", metavar="PATH", help=argparse.SUPPRESS)  # --isolate: a row process's result
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="run nothing: print one table of the rows of these --json files (e.g. the phases of a "
                        "GPU run made in separate calls), with the ratios across them; --markdown/--json as usual")
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
    # 'all' leaves out DeepSpeed's rows: they need DeepSpeed installed and --isolate (deepspeed_peer.py).
    keys = ([k for k in METHODS if k not in deepspeed_peer.ROWS] if args.methods.strip() == "all"
            else [m.strip() for m in args.methods.split(",") if m.strip()])
    unknown = [k for k in keys if layouts.split_key(k)[0] not in METHODS]
    if unknown or not keys:
        p.error(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)} (a deepcompile row may add "
                f"{layouts.SEPARATOR}LAYOUT)")
    keys = layouts.expand(keys, args.layouts, [k for k, m in METHODS.items() if m.stage is not None])
    layouts.check(p, args, keys, {k: m.stage for k, m in METHODS.items()})
    bases = [layouts.split_key(k)[0] for k in keys]
    profiled = {"z3-prefetch", "z3-auto", "z3-prefetch-regional"} | (set(OFFLOAD_KEYS) if args.offload_passes != "none" else set())
    if args.warmup < 3 and profiled & set(bases):
        p.error(f"--warmup must be >= 3 with {', '.join(sorted(profiled & set(bases)))} "
                "(profile at step 0, re-plan at step 1)")
    if args.nproc < 1:
        p.error("--nproc must be >= 1")
    if args.peer_repeats < 1:
        p.error("--peer-repeats must be >= 1")
    deepspeed_peer.check_options(p, args, bases)
    if not 0.0 < args.memory_budget_fraction <= 1.0:
        p.error("--memory-budget-fraction must be in (0, 1]")
    args.methods = keys
    if args.pcie is None:  # the bus only matters to the rows that use it; other tables stay as they were
        args.pcie = bool(set(bases) & set(OFFLOAD_KEYS))
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


def build_meta_model(ctx: Context, dtype: torch.dtype) -> torch.nn.Module:
    """The model on the ``meta`` device (no memory): ``--init meta``."""
    with torch.device("meta"), default_dtype(dtype):
        model = LlamaForCausalLM(model_config(ctx.args))
    model.train()
    return model


def init_local_shards(model: torch.nn.Module, init_fn: Callable[[torch.nn.Module], None]) -> None:
    """Run ``init_fn(module)`` for every module of an FSDP2-sharded model after ``to_empty``, on each
    parameter's local shard (plain tensors, so no DTensor random op is involved; the shard is a view
    of FSDP2's storage, written in place). With one rank the shard is the whole parameter; with
    several each rank initialises its rows with its own generator (a different, equally valid
    random model). Norm weights (ones) and rotary buffers come out exact either way."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for module in model.modules():
            sharded = {name: p for name, p in module._parameters.items() if isinstance(p, DTensor)}
            for name, p in sharded.items():
                module._parameters[name] = torch.nn.Parameter(p.to_local(), requires_grad=False)
            try:
                init_fn(module)
            finally:
                module._parameters.update(sharded)


def make_optimizer(ctx: Context, params) -> torch.optim.Optimizer:
    # The same optimizer (torch's default implementation for the device) for every method.
    return torch.optim.AdamW(params, lr=ctx.args.lr)


def make_batches(args: argparse.Namespace, rank: int, device: torch.device) -> List[torch.Tensor]:
    """Random token ids, different per rank and step (``--same-batch``: per rank only), identical for
    every method."""
    out = []
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + (0 if args.same_batch else step) * 1009 + rank)
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
    # The bytes per link of the step just run (deepcompile: engine.step_report.comm_bytes), or None.
    comm_bytes: Callable[[], Optional[Dict[str, Dict[str, int]]]] = lambda: None


OFFLOAD_PASSES = {"none": (), "prefetch": ("prefetch",), "auto": ("prefetch", "selective_gather")}
OFFLOAD_KEYS = ("z3-offload", "z3-offload-budget", "z3-offload-all", "fsdp2-offload")


def offload_config(args: argparse.Namespace, offload: str, budget_bytes: Optional[int] = None) -> Dict[str, dict]:
    """The config sections an offload row adds (``offload``: none, optimizer, budget, all):
    ``{"zero_optimization": {...}, "compile": {...}}``, merged into the row's config."""
    zero: Dict[str, object] = {}
    comp: Dict[str, object] = {}
    if offload == "optimizer":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    elif offload in ("budget", "all"):
        comp["offload_opt_states"] = True
        if offload == "all":
            comp["offload_activation"] = True
            comp["offload_parameters"] = True
        if budget_bytes is not None:
            comp["memory_budget_bytes"] = int(budget_bytes)
        elif args.memory_budget_gib is None:
            comp["memory_budget_fraction"] = args.memory_budget_fraction
    elif offload != "none":
        raise ValueError(f"unknown offload kind {offload!r}")
    return {"zero_optimization": zero, "compile": comp}


def deepcompile_config(args: argparse.Namespace, stage: int, passes: Tuple[str, ...] = (), offload: str = "none",
                       budget_bytes: Optional[int] = None) -> dict:
    """A deepcompile row's config from the options (a pure function: tests read it without an engine)."""
    config = {
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": args.reduce_bucket_size,
            "stage3_param_persistence_threshold": args.persistence_threshold,
        },
        "bf16": {"enabled": True},
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "compile": {
            "prefetch": "prefetch" in passes,
            "selective_gather": "selective_gather" in passes,
            "warmup_steps": 1,  # profile step 0, plan after it
        },
    }
    if args.memory_budget_gib is not None:
        config["compile"]["memory_budget_bytes"] = int(args.memory_budget_gib * 2**30)
    if args.sub_group_size is not None and stage == 3:
        config["zero_optimization"]["sub_group_size"] = int(args.sub_group_size)
    if args.communication_data_type is not None:
        config["communication_data_type"] = args.communication_data_type
    if args.optimizer_step_in_backward and stage == 3:
        config["compile"]["optimizer_step_in_backward"] = True
    layout = layouts.from_options(args)  # hybrid sharding / hpZ; passed through, validated by the config
    if layout.hpz_partition_size != 1 and stage != 3:  # parse_args refuses this first; other callers too
        raise ValueError(f"hpZ (zero_hpz_partition_size {layout.hpz_partition_size}) is ZeRO-3 only, not ZeRO-{stage}")
    config["zero_optimization"].update(layout.zero_keys())
    for section, values in offload_config(args, offload, budget_bytes).items():
        config[section].update(values)
    return config


def deepcompile_runner(ctx: Context, stage: int, passes: Tuple[str, ...] = (), offload: str = "none",
                       budget_bytes: Optional[int] = None, regional: bool = False) -> Runner:
    import deepcompile  # here: a DeepSpeed row's process must not load its `dc` op library (deepspeed_peer.py)

    config = deepcompile_config(ctx.args, stage, passes, offload, budget_bytes)
    meta = ctx.args.init == "meta"
    # deepcompile trains the bf16 model (fp32 masters in the engine): built on the device in bf16,
    # or on meta and materialised by initialize() one module at a time.
    model = build_meta_model(ctx, torch.bfloat16) if meta else build_model(ctx, torch.bfloat16)
    optimizer = make_optimizer(ctx, model.parameters())  # re-targeted at the fp32 master shards
    init = dict(init_fn=model._init_weights, device=ctx.device) if meta else {}
    if meta:
        torch.manual_seed(ctx.args.seed)  # init_fn runs from rank 0's generator state
    try:
        engine = deepcompile.initialize(model, optimizer, config, **init)
    except BaseException as e:
        deepcompile.runtime.cleanup()  # initialize may fail after creating the runtime
        if offload == "all" and isinstance(e, (ValueError, NotImplementedError)):
            # An offload kind this build refuses (config validation): the row says which, the table goes on.
            raise Unavailable("unavailable: " + " ".join(str(e).split())[:300]) from e
        raise
    engine.compile(backend=ctx.backend, regional=regional)

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
        what = "outside the compiled layers" if regional else "(graph breaks)"
        notes = [f"{len(eager)} parameters gathered eagerly {what}"] if eager else []
        step_in_backward = engine.sharding.backward_step
        if step_in_backward is not None:  # compile.optimizer_step_in_backward: how much it took on
            notes.append(f"{len(step_in_backward.stepped_last_window)} of {len(step_in_backward.trainable)} "
                         "parameters stepped in the last backward")
        if getattr(engine, "offload", None) is not None:
            notes.append(offload_note(engine.offload.report()))
        if offload != "none":
            sync(ctx)
            if ctx.is_cuda:
                notes.append(f"between steps {torch.cuda.memory_allocated(ctx.device) / GIB:.2f} GiB")
        return "; ".join(notes)

    def comm_bytes() -> Optional[Dict[str, Dict[str, int]]]:
        counted = engine.step_report.comm_bytes  # replaced (not updated) at every optimizer step
        return {link: dict(kinds) for link, kinds in counted.items()} if counted else None

    return Runner(step, close=engine.destroy, note=note, scheduled=lambda: last["scheduled"], comm_bytes=comm_bytes)


def offload_note(r: Dict[str, object]) -> str:
    """What the optimizer-state offload plan moved (``engine.offload.report()``)."""
    total = (r.get("offloaded_bytes") or 0) + (r.get("resident_bytes") or 0)
    budget = r.get("budget_bytes")
    return (f"opt states offloaded {size(r.get('offloaded_bytes') or 0)} of {size(total)}, "
            f"reloaded in backward {size(r.get('reloaded_during_backward_bytes') or 0)}, budget "
            + (size(budget) if budget else "none"))


def size(nbytes: float) -> str:
    """GiB, or MiB below one GiB (the tiny CPU models)."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.2f} MiB"


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


def fsdp2_runner(ctx: Context, cpu_offload: bool = False) -> Runner:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    meta = ctx.args.init == "meta"
    # fp32 shards are the master weights
    model = build_meta_model(ctx, torch.float32) if meta else build_model(ctx, torch.float32)
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    shard = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    if cpu_offload:  # parameters, gradients and the optimizer step on the host, pinned for the copies
        # (on a CPU smoke run there is nothing to pin for: the same code path, unpinned)
        shard["offload_policy"] = CPUOffloadPolicy(pin_memory=ctx.is_cuda)
    for layer in model.model.layers:
        fully_shard(layer, **shard)
    fully_shard(model, **shard)  # root: embeddings, final norm, LM head
    if meta:
        # The usual FSDP2 recipe: shards get storage (on the host when offloaded), then values.
        model.to_empty(device="cpu" if cpu_offload else ctx.device)
        torch.manual_seed(ctx.args.seed)
        init_local_shards(model, model._init_weights)
        if cpu_offload:  # FSDP2 moves parameters only: buffers (rotary inv_freq) go to the device
            for module in model.modules():
                for name, b in module._buffers.items():
                    if b is not None:
                        module._buffers[name] = b.to(ctx.device)
    optimizer = make_optimizer(ctx, model.parameters())  # DTensor shards (on the host with offload)
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
    stage: Optional[int] = None  # deepcompile rows: the ZeRO stage (they take a layout); peers: None
    layout: Optional[str] = None  # the row's layout label (bench/layouts.py), where it has one


# The rows; the keys are what --methods takes (the table follows the order given there; 'all' is this order).
METHODS: Dict[str, Method] = {
    "z3": Method("deepcompile ZeRO-3", lambda ctx: deepcompile_runner(ctx, stage=3), stage=3),
    "z3-prefetch": Method("deepcompile ZeRO-3 + prefetch",
                          lambda ctx: deepcompile_runner(ctx, stage=3, passes=("prefetch",)), stage=3),
    "z3-auto": Method("deepcompile ZeRO-3 + prefetch + selective",
                      lambda ctx: deepcompile_runner(ctx, stage=3, passes=("prefetch", "selective_gather")),
                      stage=3),
    "z3-prefetch-regional": Method("deepcompile ZeRO-3 + prefetch, per layer",
                                   lambda ctx: deepcompile_runner(ctx, stage=3, passes=("prefetch",), regional=True),
                                   stage=3),
    "z1": Method("deepcompile ZeRO-1", lambda ctx: deepcompile_runner(ctx, stage=1), stage=1),
    "z2": Method("deepcompile ZeRO-2", lambda ctx: deepcompile_runner(ctx, stage=2), stage=2),
    "fsdp2": Method(FSDP2_NAME, fsdp2_runner),
    "fsdp2-offload": Method(FSDP2_OFFLOAD_NAME, lambda ctx: fsdp2_runner(ctx, cpu_offload=True)),
    "z3-offload": Method("deepcompile ZeRO-3 + offload_optimizer",
                         lambda ctx: deepcompile_runner(ctx, 3, OFFLOAD_PASSES[ctx.args.offload_passes], "optimizer"),
                         stage=3),
    "z3-offload-budget": Method("deepcompile ZeRO-3 + offload_opt_states, budget",
                                lambda ctx: deepcompile_runner(ctx, 3, OFFLOAD_PASSES[ctx.args.offload_passes],
                                                               "budget"),
                                stage=3),
    "z3-offload-all": Method("deepcompile ZeRO-3 + all offload kinds, budget",
                             lambda ctx: deepcompile_runner(ctx, 3, OFFLOAD_PASSES[ctx.args.offload_passes], "all"),
                             stage=3),
    "ddp": Method("DDP + compile", ddp_runner),
    **{key: Method(name, lambda ctx, key=key: deepspeed_peer.runner(ctx, key))
       for key, name in deepspeed_peer.ROWS.items()},
}
METHODS = {key: dataclasses.replace(m, key=key) for key, m in METHODS.items()}
DEFAULT_METHODS = ["z3", "z3-prefetch", "z3-auto", "z1", "z2", "fsdp2", "ddp"]
# --peer-repeats runs each of these that many times in one call (their step times vary from run to run).
REPEATED_PEERS = ("fsdp2", *deepspeed_peer.ROWS)


def method_of(key: str, args: argparse.Namespace) -> Method:
    """The row of a ``--methods`` key: ``METHODS[key]``, or, for a deepcompile row with a layout
    (its own, ``z3@2x1``, or the options' --shard-group-size/--hpz-partition-size), that method
    built with the layout and labelled with it (bench/layouts.py)."""
    base, token = layouts.split_key(key)
    m = METHODS[base]
    if m.stage is None or (token is None and layouts.from_options(args).is_plain):
        return m  # a peer, or a deepcompile row as it always was
    layout = layouts.row_layout(key, args)

    def build(ctx: Context) -> Runner:
        error = layout.world_error(ctx.world)
        if error:
            raise ValueError(error)
        return m.build(dataclasses.replace(ctx, args=layouts.with_layout(ctx.args, layout)))

    return dataclasses.replace(m, name=f"{m.name} [{layout.label()}]", build=build, key=key, layout=layout.label())


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
    losses: Optional[List[float]] = None  # every step's loss, warm-up included (JSON only)
    # --trace: rank 0's step_trace.transfer_summary (per step: h2d_ms, h2d_hidden_ms, h2d_gb, the
    # same for d2h, transfer_ms, hidden_ms, step_ms)
    transfers: Optional[Dict[str, float]] = None
    vs_fsdp2_offload: Optional[float] = None  # tokens/s over FSDP2 + CPU offload's, same run
    host_peak_gib: Optional[float] = None  # --isolate: the row process's peak resident memory
    repeat: Optional[int] = None  # --peer-repeats: which run of a repeated row (shown after its name)
    layout: Optional[str] = None  # a deepcompile row's layout (bench/layouts.py; also in its label)
    # rank 0's bytes per link of the last measured step (engine.step_report.comm_bytes): per link
    # ("shard", "replica", "secondary") ranks, payload bytes per collective kind, and wire bytes
    comm_bytes: Optional[Dict[str, Dict[str, int]]] = None


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


def compare_with_fsdp2(rows: List[Row]) -> None:
    """Fill ``vs_fsdp2``: each row's time to its first scheduled step over FSDP2 + compile's
    first step in this run (left empty without an FSDP2 row)."""
    fsdp2 = next((r for r in rows if r.method == FSDP2_NAME and r.status == "ok"), None)
    if fsdp2 is None or not fsdp2.compile_s:
        return
    for r in rows:
        if r.status == "ok" and r.scheduled_s is not None:
            r.vs_fsdp2 = r.scheduled_s / fsdp2.compile_s


def compare_with_fsdp2_offload(rows: List[Row]) -> None:
    """Fill ``vs_fsdp2_offload``: each row's tokens/s over FSDP2 + CPU offload's in this run
    (issue 18's target: at least 5x)."""
    peer = next((r for r in rows if r.method == FSDP2_OFFLOAD_NAME and r.status == "ok"), None)
    if peer is None or not peer.tokens_per_s:
        return
    for r in rows:
        if r.status == "ok" and r.tokens_per_s:
            r.vs_fsdp2_offload = r.tokens_per_s / peer.tokens_per_s


def pcie_floor_ms(transfers: Optional[Dict[str, float]], pcie: Optional[Dict[str, float]]) -> Optional[float]:
    """The step time if host-device copies were all that ran: each direction's bytes per step over
    that direction's bandwidth when both run at once (the directions overlap each other), the
    larger of the two. None without a trace or a bandwidth."""
    if not transfers or not pcie or "error" in pcie:
        return None
    h2d = transfers["h2d_gb"] / pcie["both_h2d_gb_s"] if transfers["h2d_gb"] else 0.0
    d2h = transfers["d2h_gb"] / pcie["both_d2h_gb_s"] if transfers["d2h_gb"] else 0.0
    return 1e3 * max(h2d, d2h)


# ------------------------------------------------------------------------------------- output

COLUMNS = ["method", "step time (ms)", "tokens/s/GPU", "TFLOP/s/GPU", "peak mem (GiB)", "first step (s)",
           "first scheduled step (s)", "÷ FSDP2 first step", "warm: first scheduled step (s)", "loss", "note"]
# Shown only when some row has them (offload runs): before "loss".
OFFLOAD_COLUMNS = ["× FSDP2 offload tokens/s", "transfer / hidden ms (%)", "GB moved/step", "PCIe floor (ms)",
                   "traced step (ms)", "host peak (GiB)"]


def _num(row: Row, value: Optional[float], fmt: str) -> str:
    if row.status != "ok":
        return row.status  # "n/a", "OOM", "error", "timeout" or "killed" in every number column
    if value is None:
        return "n/a"
    # Tiny smoke-run models would print 0.0; keep three significant digits there.
    return format(value, fmt) if abs(value) >= 1 or value == 0 else format(value, ".3g")


def transfer_cell(transfers: Optional[Dict[str, float]]) -> str:
    """ "transfer / hidden ms (%)": H2D + D2H copy time per step and the part hidden behind kernels."""
    if not transfers:
        return "n/a"
    busy, hidden = transfers["transfer_ms"], transfers["hidden_ms"]
    pct = f"{100 * hidden / busy:.0f} %" if busy else "-"
    return f"{busy:.1f} / {hidden:.1f} ({pct})"


def show_offload_columns(rows: List[Row]) -> bool:
    return any(r.transfers or r.vs_fsdp2_offload is not None or r.host_peak_gib is not None for r in rows)


def show_comm_column(rows: List[Row]) -> bool:
    return any(r.comm_bytes for r in rows)


def columns(rows: List[Row]) -> List[str]:
    """The table's head: the comm column where some row counted its bytes per link (deepcompile
    rows), the offload columns where some row has offload data, both before "loss"."""
    extra = ([layouts.COMM_COLUMN] if show_comm_column(rows) else []) + \
        (OFFLOAD_COLUMNS if show_offload_columns(rows) else [])
    return COLUMNS[:-2] + extra + COLUMNS[-2:]


def cells(row: Row, offload_columns: bool = False, pcie: Optional[Dict[str, float]] = None,
          comm_column: bool = False) -> List[str]:
    num = lambda value, fmt: _num(row, value, fmt)
    label = row.method + (f" (run {row.repeat})" if row.repeat else "")
    out = [label, num(row.step_ms, ".1f"), num(row.tokens_per_s, ",.0f"), num(row.tflops, ".1f"),
           num(row.peak_gib, ".2f"), num(row.compile_s, ".1f"), num(row.scheduled_s, ".1f"),
           num(row.vs_fsdp2, ".2f"), num(row.warm_scheduled_s, ".1f")]
    if comm_column:
        out.append(layouts.comm_cell(row.comm_bytes) if row.status == "ok" else row.status)
    if offload_columns:
        t = row.transfers
        out += [num(row.vs_fsdp2_offload, ".2f"),
                transfer_cell(t) if row.status == "ok" else row.status,
                num(t["h2d_gb"] + t["d2h_gb"] if t else None, ".2f"),
                num(pcie_floor_ms(t, pcie), ".1f"),
                num(t["step_ms"] if t else None, ".1f"),
                format(row.host_peak_gib, ".1f") if row.host_peak_gib is not None else "n/a"]
    return out + [num(row.loss, ".4f"), row.note]


def text_table(rows: List[Row], pcie: Optional[Dict[str, float]] = None) -> str:
    head = columns(rows)
    wide, comm = show_offload_columns(rows), show_comm_column(rows)
    body = [head] + [cells(r, wide, pcie, comm) for r in rows]
    widths = [max(len(line[i]) for line in body) for i in range(len(head))]
    fmt = lambda line: "  ".join(c.ljust(w) if i in (0, len(line) - 1) else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(line, widths))).rstrip()
    rule = "-" * len(fmt(head))
    return "\n".join([fmt(head), rule] + [fmt(line) for line in body[1:]])


def markdown_table(rows: List[Row], pcie: Optional[Dict[str, float]] = None) -> str:
    head = columns(rows)
    wide, comm = show_offload_columns(rows), show_comm_column(rows)
    esc = lambda s: s.replace("|", "\\|")
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(head) - 2) + ["---"]) + " |"]
    lines += ["| " + " | ".join(esc(c) for c in cells(r, wide, pcie, comm)) + " |" for r in rows]
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


def environment(ctx: Context, pcie: Optional[Dict[str, float]] = None) -> Dict[str, str]:
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
                        f"stage3_param_persistence_threshold {a.persistence_threshold:,}"
                        + (f", communication_data_type {a.communication_data_type}"
                           if a.communication_data_type else "")
                        + (f", sub_group_size {a.sub_group_size:.0e}" if a.sub_group_size else "")
                        + (", optimizer_step_in_backward" if a.optimizer_step_in_backward else "")),
        "FLOPs/token": f"{flops_per_token(a, ctx.n_params) / 1e9:.3f} G (6 N + 12 L H S)",
        "init": {"device": "built on the device in the training dtype",
                 "meta": "built on meta; deepcompile.initialize(init_fn=, device=) / FSDP2 to_empty + init"}[a.init],
        "PCIe": describe_pcie(pcie) if ctx.is_cuda else "n/a (CPU)",
    }


def describe_pcie(pcie: Optional[Dict[str, float]]) -> str:
    from pcie_bench import describe

    return describe(pcie)


def host_peak_bytes() -> Optional[int]:
    """This process's peak resident memory (VmHWM; pinned host buffers count once touched)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def append_markdown(path: str, env: Dict[str, str], rows: List[Row], pcie: Optional[Dict[str, float]] = None) -> None:
    lines = [f"## {env['date (UTC)']} UTC, {env['device']}", ""]
    lines += [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in env.items()]
    lines += ["", markdown_table(rows, pcie), ""]
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        if new:
            f.write("# Benchmark results (bench/train_bench.py)\n\n")
        f.write("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------- main


def write_json(path: str, env: Dict[str, str], rows: List[Row], pcie: Optional[Dict[str, float]]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"env": env, "pcie": pcie, "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)


def finish(args: argparse.Namespace, env: Dict[str, str], rows: List[Row], pcie: Optional[Dict[str, float]]) -> None:
    """The ratios, the table and its files (rank 0 / the parent of --isolate)."""
    peer_rows.number_repeats(rows)
    compare_with_fsdp2(rows)
    compare_with_fsdp2_offload(rows)
    print("\n" + text_table(rows, pcie), flush=True)
    if args.markdown:
        append_markdown(args.markdown, env, rows, pcie)
        print(f"\nappended to {args.markdown}", flush=True)
    if args.json:
        write_json(args.json, env, rows, pcie)
        print(f"wrote {args.json}", flush=True)


def merge(args: argparse.Namespace) -> int:
    """--merge: one table of the rows of several --json files; the header is the first file's, the
    PCIe figure the first one measured (each file's own is listed)."""
    env: Dict[str, str] = {}
    rows: List[Row] = []
    pcie = None
    for i, path in enumerate(args.merge):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        env = env or dict(data["env"])
        env[f"part {i + 1}"] = f"{path}: {data['env'].get('command', '?')} ({data['env'].get('date (UTC)', '?')} UTC)"
        if data.get("pcie") and "error" not in data["pcie"]:
            pcie = pcie or data["pcie"]
            env[f"part {i + 1} PCIe"] = describe_pcie(data["pcie"])
        fields = {f.name for f in dataclasses.fields(Row)}
        for r in data["rows"]:
            r = {k: v for k, v in r.items() if k in fields}
            r.update(vs_fsdp2=None, vs_fsdp2_offload=None)  # recomputed across all parts
            rows.append(Row(**r))
    env["command"] = "python3 " + shlex.join(sys.argv)
    print("\n".join(f"{k}: {v}" for k, v in env.items()), flush=True)
    finish(args, env, rows, pcie)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.merge:
        return merge(args)
    args.methods = peer_rows.repeat_peers(args, REPEATED_PEERS)
    if args.isolate:
        from row_process import run_isolated

        return run_isolated(args, peer_rows.row_argv(sys.argv[1:] if argv is None else argv))
    device, rank, world = setup()
    backend = args.backend or ("inductor" if device.type == "cuda" else "eager")
    if args.compile_cache == "off":
        # Also keeps artifacts of older builds out (NOTES.md: cached graphs and dc op registrations).
        import torch._inductor.config as inductor_config

        inductor_config.force_disable_caches = True
    pcie = None
    if args.pcie and device.type == "cuda" and rank == 0:
        from pcie_bench import measure as measure_pcie

        try:
            pcie = measure_pcie(device, args.pcie_gib, args.pcie_repeats)
        except Exception as e:  # the table is still worth having; the header says why there is no figure
            pcie = {"error": f"{type(e).__name__}: {e}"}
        torch.cuda.empty_cache()
    if device.type == "cuda":
        dist.barrier()
    ctx = Context(args, device, backend, rank, world, make_batches(args, rank, device), count_params(args))
    env = environment(ctx, pcie)
    if rank == 0:
        print("\n".join(f"{k}: {v}" for k, v in env.items()), flush=True)

    mismatched = layouts.world_errors(args.methods, args, world)
    if mismatched:  # every rank sees the same: all stop before any row, the message once
        if rank == 0:
            print("layouts that do not fit this run:\n  " + "\n  ".join(mismatched), file=sys.stderr, flush=True)
        dist.destroy_process_group()
        return 2
    rows = []
    for key in args.methods:
        method = method_of(key, args)
        if rank == 0:
            print(f"== {method.name}", flush=True)
        mine = measure(ctx, method)
        everyone: List[Optional[RankMeasurement]] = [None] * world
        dist.all_gather_object(everyone, mine)
        row = combine(ctx, method, everyone)
        if args.child_json:  # one row per process: the process's peak is the row's
            peaks: List[Optional[int]] = [None] * world
            dist.all_gather_object(peaks, host_peak_bytes())
            if all(p is not None for p in peaks):
                row.host_peak_gib = max(peaks) / GIB
        rows.append(row)
        if rank == 0:
            summary = (", ".join(f"{c}: {v}" for c, v in zip(COLUMNS[1:-1], cells(row)[1:-1])) if row.status == "ok"
                       else f"{row.status}: {row.note}")
            if row.comm_bytes:
                summary += f", {layouts.COMM_COLUMN}: {layouts.comm_cell(row.comm_bytes)}"
            print("  " + summary, flush=True)

    if rank == 0:
        if args.child_json:  # a row process of --isolate: the parent prints the table
            write_json(args.child_json, env, rows, pcie)
        else:
            finish(args, env, rows, pcie)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
