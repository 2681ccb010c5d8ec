"""All-gather bandwidth: deepcompile's runtime gather against plain NCCL, side by side.

    torchrun --nproc-per-node 2 bench/comm_bench.py [--sizes-mib 16,64,256,1024] [--iters 10]
                                                    [--markdown bench/results/DATE.md]

For each size (bytes of the *gathered* tensor, bf16 on GPU, fp32 on CPU):

* ``torch.distributed``: ``all_gather_into_tensor`` on the default process group (NCCL), the
  reference bus bandwidth of this machine;
* ``deepcompile``: one ZeRO-3 parameter of that size registered with the runtime, gathered the
  way a graph gathers it: ``dc.allgather_param`` + ``dc.wait_allgather`` (the compute stream
  waits for the runtime's all-gather lane), then ``dc.release_param`` (buffer freed).

Time is measured with CUDA events on the current stream around ``--iters`` back-to-back
repetitions after a warm-up (wall clock on CPU). Bus bandwidth = size * (world - 1) / world /
time, the usual NCCL convention, so it is comparable across world sizes. The last column is the
runtime's share of the reference bandwidth (the project's target: at least 90 % for large
gathers).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from typing import Callable, List, Tuple

import torch
import torch.distributed as dist

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import deepcompile  # noqa: E402,F401  (registers torch.ops.dc)
from deepcompile import runtime  # noqa: E402
from dist_setup import setup  # noqa: E402

ops = torch.ops.dc
GRAPH = 1


def timed(fn: Callable[[], None], iters: int, cuda: bool) -> float:
    """Milliseconds per call of ``fn``, after one warm-up call."""
    fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def measure(sizes_mib: List[float], iters: int, device: torch.device) -> List[Tuple[int, float, float]]:
    cuda = device.type == "cuda"
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = torch.bfloat16 if cuda else torch.float32
    runtime.init(None, runtime.RuntimeConfig(), device=device.type)
    results = []
    for ds_id, mib in enumerate(sizes_mib):
        numel = int(mib * 2**20) // dtype.itemsize // world * world
        ppr = numel // world
        shard = torch.randn(ppr, device=device).to(dtype)
        full = torch.empty(numel, dtype=dtype, device=device)

        def nccl() -> None:
            dist.all_gather_into_tensor(full, shard)

        runtime.register_z3_param(ds_id, [numel], shard)
        runtime.register_graph(GRAPH, [ds_id], stage=3)

        def runtime_gather() -> None:
            gathered = ops.wait_allgather(ops.allgather_param(shard, GRAPH, ds_id), GRAPH, ds_id)
            ops.release_param(gathered, GRAPH, ds_id, 1)

        t_nccl = timed(nccl, iters, cuda)
        t_dc = timed(runtime_gather, iters, cuda)
        times = torch.tensor([t_nccl, t_dc], dtype=torch.float64, device=device if cuda else "cpu")
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        results.append((numel * dtype.itemsize, times[0].item(), times[1].item()))
        del shard, full
    runtime.cleanup()
    return results


def table(results: List[Tuple[int, float, float]], world: int) -> List[str]:
    bus = lambda nbytes, ms: nbytes * (world - 1) / world / (ms / 1e3) / 1e9
    lines = ["| gathered size | NCCL (ms) | NCCL bus GB/s | deepcompile (ms) | deepcompile bus GB/s | share |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for nbytes, t_nccl, t_dc in results:
        b_nccl, b_dc = bus(nbytes, t_nccl), bus(nbytes, t_dc)
        lines.append(f"| {nbytes / 2**20:,.0f} MiB | {t_nccl:.3f} | {b_nccl:.1f} | {t_dc:.3f} | {b_dc:.1f} | "
                     f"{100 * b_dc / b_nccl:.0f} % |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", default=None, help="comma list (default: 16,64,256,1024 on GPU; 1,4 on CPU)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--markdown", metavar="PATH")
    args = p.parse_args()
    device, _, _ = setup()
    default = "16,64,256,1024" if device.type == "cuda" else "1,4"
    sizes = [float(s) for s in (args.sizes_mib or default).split(",")]
    results = measure(sizes, args.iters, device)
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo)"
        head = [f"## All-gather bandwidth, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
                f"{dist.get_world_size()} x {name}", "",
                f"- command: `torchrun --nproc-per-node {dist.get_world_size()} {' '.join(sys.argv)}`",
                f"- torch {torch.__version__}" + (f", NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
                                                   if device.type == "cuda" else ""), ""]
        text = "\n".join(head + table(results, dist.get_world_size()))
        print(text, flush=True)
        if args.markdown:
            with open(args.markdown, "a", encoding="utf-8") as f:
                f.write("\n" + text + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
