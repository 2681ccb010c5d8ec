"""Where a training step's time goes: a torch.profiler summary of a few steps, as small text.

Used by ``train_bench.py --trace DIR``: after a method's measured steps, ``trace_steps`` runs
``steps`` more under ``torch.profiler`` and rank 0 writes ``DIR/<method key>.txt`` holding

* a breakdown of device time by kind: NCCL kernels, other kernels, memory copies/sets, against
  the wall time of the traced steps (device time above the wall time means streams overlapped;
  far below means the GPU waited, e.g. for the host);
* the top operators by self CPU time (host overhead: dispatcher, runtime ops, Python);
* the top operators and kernels by device time;
* how communication overlaps computation: the time some compute kernel runs, the time some NCCL
  kernel runs, and the NCCL time with no compute kernel running at all (communication the step
  waits for: exposed), against the wall time.

Next to it, for a closer look offline, ``DIR/<method key>.trace.json.gz`` (the Chrome trace,
gzipped: a few MiB instead of tens) and ``DIR/<method key>.memory.pickle.gz`` (the allocator's
history of the traced steps with Python stacks, for ``torch.cuda.memory._snapshot`` tools or
``bench/memory_peak.py``).
"""

from __future__ import annotations

import gzip
import os
import shutil
import time
from typing import Callable, Iterable, List, Tuple

import torch


def _device_time_us(event) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, attr):
            return float(getattr(event, attr))
    return 0.0


def _kind(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return "nccl kernels"
    if "memcpy" in low or "memset" in low:
        return "memcpy/memset"
    return "other kernels"


def _union_us(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """Merge [start, end) intervals into disjoint ones, sorted."""
    merged: List[Tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: List[Tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _intersection_length(a: List[Tuple[float, float]], b: List[Tuple[float, float]]) -> float:
    """Total overlap of two disjoint, sorted interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_lines(kernels: List[Tuple[str, float, float]], wall_ms: float, steps: int) -> List[str]:
    """Busy time of compute and NCCL kernels (each a union over all streams) and the NCCL time
    no compute kernel hides, from (name, start_us, end_us) of every device kernel."""
    nccl = _union_us([(s, e) for name, s, e in kernels if "nccl" in name.lower()])
    compute = _union_us([(s, e) for name, s, e in kernels if "nccl" not in name.lower()])
    per = max(steps, 1)
    compute_ms, nccl_ms = _length(compute) / 1e3, _length(nccl) / 1e3
    exposed_ms = nccl_ms - _intersection_length(nccl, compute) / 1e3
    idle_ms = wall_ms - _length(_union_us(nccl + compute)) / 1e3
    return [
        f"compute kernels busy: {compute_ms / per:.1f} ms/step ({100 * compute_ms / wall_ms:.0f} % of wall)",
        f"nccl kernels busy:    {nccl_ms / per:.1f} ms/step",
        f"nccl with no compute running (exposed): {exposed_ms / per:.1f} ms/step",
        f"no kernel running at all (host-bound or waiting): {idle_ms / per:.1f} ms/step",
    ]


def generated_kernel_line(kernels: List[Tuple[str, float, float]], steps: int) -> str:
    """Launches and time of the kernels Inductor generated (Triton's ``triton_*``): more launches
    for the same model means fusion regions were split."""
    generated = [(s, e) for name, s, e in kernels if name.startswith("triton_")]
    per = max(steps, 1)
    return (f"inductor-generated kernels: {len(generated) / per:.0f} launches/step, "
            f"{sum(e - s for s, e in generated) / 1e3 / per:.1f} ms/step")


def trace_steps(step: Callable[[torch.Tensor], torch.Tensor], batches: Iterable[torch.Tensor], sync: Callable[[], None],
                path: str, title: str, write: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    batches = list(batches)
    sync()
    record_memory = torch.cuda.is_available() and write
    if record_memory:
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for tokens in batches:
            step(tokens)
        sync()
        wall_ms = (time.perf_counter() - start) * 1e3
    if not write:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    stem = path[: -len(".txt")] if path.endswith(".txt") else path
    if record_memory:
        _write_gzipped(stem + ".memory.pickle", torch.cuda.memory._dump_snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    _write_gzipped(stem + ".trace.json", prof.export_chrome_trace)
    kernels = [(e.name, float(e.time_range.start), float(e.time_range.end)) for e in prof.events()
               if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA")]
    kinds = {"nccl kernels": 0.0, "other kernels": 0.0, "memcpy/memset": 0.0}
    for e in prof.events():
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
            kinds[_kind(e.name)] += _device_time_us(e) / 1e3
    sort_device = "self_device_time_total" if hasattr(prof.key_averages()[0], "self_device_time_total") \
        else "self_cuda_time_total"
    lines = [f"# {title}: {len(batches)} traced step(s), wall {wall_ms:.1f} ms ({wall_ms / max(len(batches), 1):.1f} ms/step)", ""]
    lines += [f"device time, {k}: {v:.1f} ms ({v / max(len(batches), 1):.1f} ms/step)" for k, v in kinds.items()]
    lines += [generated_kernel_line(kernels, len(batches))]
    lines += [""] + overlap_lines(kernels, wall_ms, len(batches))
    lines += ["", "## top operators by self CPU time",
              prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)]
    if torch.cuda.is_available():
        lines += ["", "## top operators and kernels by self device time",
                  prof.key_averages().table(sort_by=sort_device, row_limit=25, max_name_column_width=60)]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def _write_gzipped(path: str, write: Callable[[str], None]) -> None:
    """``write(path)``, then gzip the file in place (``path + ".gz"``)."""
    write(path)
    with open(path, "rb") as raw, gzip.open(path + ".gz", "wb", compresslevel=6) as packed:
        shutil.copyfileobj(raw, packed)
    os.remove(path)
