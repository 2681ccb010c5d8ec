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

import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/'s own modules

# The bench's parts (bench/README.md, "How train_bench is built"); their names are re-exported here
# for the scripts that drive train_bench (compile_time.py, checkpointing_memory.py, ...).
import layouts  # noqa: E402
import peer_rows  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from dist_setup import setup  # noqa: E402
from run_deepcompile import (OFFLOAD_PASSES, deepcompile_config, deepcompile_runner, offload_config,  # noqa: E402,F401
                             offload_note, size)
from run_torch import ddp_runner, fsdp2_runner, torch_training_runner  # noqa: E402,F401
from train_core import (GIB, REPO_ROOT, Context, Runner, Unavailable, build_meta_model, build_model,  # noqa: E402,F401
                        count_params, default_dtype, flops_per_token, init_local_shards, make_batches,
                        make_optimizer, model_config, sync, teardown)
from train_measure import (RankMeasurement, combine, compile_cache, measure, time_to_schedule,  # noqa: E402,F401
                           warm_restart)
from train_options import COMPILE_CACHES, PRESETS, parse_args  # noqa: E402,F401
from train_report import (COLUMNS, OFFLOAD_COLUMNS, Row, append_markdown, cells, columns,  # noqa: E402,F401
                          compare_with_fsdp2, compare_with_fsdp2_offload, describe_pcie, environment, finish,
                          git_revision, host_peak_bytes, markdown_table, merge, pcie_floor_ms, source_digest,
                          text_table, transfer_cell, write_json)
from train_rows import (DEFAULT_METHODS, FAMILIES, FSDP2_NAME, FSDP2_OFFLOAD_NAME, METHODS,  # noqa: E402,F401
                        OFFLOAD_KEYS, REPEATED_PEERS, ROWS, Method, method_of)


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
