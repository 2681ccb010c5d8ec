"""Host-device copy bandwidth over PCIe: pinned host memory to the GPU, back, and both at once.

    python3 bench/pcie_bench.py [--gib 1] [--repeats 5] [--json PATH]

The offload rows of ``train_bench.py`` move optimizer state (and, planned, parameters and
activations) between pinned host buffers and the device; their transfer time per step is only
meaningful next to what the bus can do on the same machine, so ``train_bench.py`` runs this
measurement in the same run and prints it above its table.

Per direction: ``--repeats`` copies of ``--gib`` GiB each (after one untimed copy that pays for
first-touch and mapping costs), timed with CUDA events around all of them, as GB/s (1e9 bytes per
second). "Both at once": an H2D copy on one stream and a D2H copy on another, each ``--repeats``
times, started together; each direction's rate over the time both took, and their sum (the
copy engines of the two directions are independent, so the sum can approach twice one direction;
the host memory system is then usually the limit).
"""

from __future__ import annotations

import argparse
import json
from typing import Dict, Optional

import torch

GB = 1e9
GIB = 1024**3


def gb_per_s(nbytes: int, seconds: float) -> float:
    """Decimal GB/s (as PCIe links are rated)."""
    return nbytes / seconds / GB


def measure(device: torch.device, gib: float = 1.0, repeats: int = 5) -> Dict[str, float]:
    """GB/s of pinned H2D, D2H and both at once on ``device`` (a CUDA device)."""
    if device.type != "cuda":
        raise ValueError(f"PCIe bandwidth needs a CUDA device, got {device}")
    nbytes = int(gib * GIB)
    host_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    host_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dev_dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d_stream, d2h_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def timed(stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            for _ in range(repeats):
                dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    try:
        torch.cuda.synchronize(device)
        timed(h2d_stream, dev_dst, host_src)  # untimed: first use of each buffer
        timed(d2h_stream, host_dst, dev_src)
        h2d = timed(h2d_stream, dev_dst, host_src)
        d2h = timed(d2h_stream, host_dst, dev_src)

        # Both directions together: the two streams start after one common event.
        go = torch.cuda.Event(enable_timing=True)
        go.record(torch.cuda.current_stream(device))
        ends = []
        for stream, dst, src in ((h2d_stream, dev_dst, host_src), (d2h_stream, host_dst, dev_src)):
            stream.wait_event(go)
            with torch.cuda.stream(stream):
                for _ in range(repeats):
                    dst.copy_(src, non_blocking=True)
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
            ends.append(end)
        for end in ends:
            end.synchronize()
        both_h2d, both_d2h = (go.elapsed_time(end) / 1e3 for end in ends)
    finally:
        torch.cuda.synchronize(device)
    moved = nbytes * repeats
    return {
        "bytes_per_copy": nbytes, "repeats": repeats,
        "h2d_gb_s": gb_per_s(moved, h2d), "d2h_gb_s": gb_per_s(moved, d2h),
        "both_h2d_gb_s": gb_per_s(moved, both_h2d), "both_d2h_gb_s": gb_per_s(moved, both_d2h),
        "both_total_gb_s": gb_per_s(2 * moved, max(both_h2d, both_d2h)),
    }


def describe(result: Optional[Dict[str, float]]) -> str:
    """One line for the table's header."""
    if not result:
        return "not measured"
    if "error" in result:
        return f"not measured: {result['error']}"
    return (f"pinned, {result['repeats']} x {result['bytes_per_copy'] / GIB:g} GiB: H2D {result['h2d_gb_s']:.1f} GB/s, "
            f"D2H {result['d2h_gb_s']:.1f} GB/s, both at once {result['both_h2d_gb_s']:.1f} + "
            f"{result['both_d2h_gb_s']:.1f} = {result['both_total_gb_s']:.1f} GB/s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="GiB per copy")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = p.parse_args()
    try:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        result = measure(torch.device("cuda", torch.cuda.current_device()), args.gib, args.repeats)
    except Exception as e:  # the caller prints the reason instead of a bandwidth
        result = {"error": f"{type(e).__name__}: {e}"}
    print("PCIe: " + describe(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
