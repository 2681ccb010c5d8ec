"""The command line of ``bench/train_bench.py``: its presets and :func:`parse_args` (the usage and
what each row does: train_bench.py's docstring)."""

from __future__ import annotations

import argparse
from typing import Dict, List, Optional

import deepspeed_peer
import layouts
from run_deepcompile import OFFLOAD_PASSES
from train_rows import DEFAULT_METHODS, METHODS, OFFLOAD_KEYS, REPEATED_PEERS

DESCRIPTION = "Training throughput and memory of deepcompile ZeRO-1/2/3 against FSDP2 and DDP, in one table."
COMPILE_CACHES = ("cold", "shared", "off")

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
    p = argparse.ArgumentParser(description=DESCRIPTION,
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
