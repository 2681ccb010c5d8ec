"""Where a training step's time goes: a torch.profiler summary of a few steps, as small text.

Used by ``train_bench.py --trace DIR``: after a method's measured steps, ``trace_steps`` runs
``steps`` more under ``torch.profiler`` and rank 0 writes ``DIR/<method key>.txt`` holding

* a breakdown of device time by kind: NCCL kernels, other kernels, memory copies/sets, against
  the wall time of the traced steps (device time above the wall time means streams overlapped;
  far below means the GPU waited, e.g. for the host);
* the top operators by self CPU time (host overhead: dispatcher, runtime ops, Python);
* the top operators and kernels by device time.

Chrome traces of a 1B-parameter step are tens of MiB; these summaries are a few KiB, small enough
to come back from a GPU machine and to compare methods side by side.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Iterable

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


def trace_steps(step: Callable[[torch.Tensor], torch.Tensor], batches: Iterable[torch.Tensor], sync: Callable[[], None],
                path: str, title: str, write: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    batches = list(batches)
    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for tokens in batches:
            step(tokens)
        sync()
        wall_ms = (time.perf_counter() - start) * 1e3
    if not write:
        return
    kinds = {"nccl kernels": 0.0, "other kernels": 0.0, "memcpy/memset": 0.0}
    for e in prof.events():
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
            kinds[_kind(e.name)] += _device_time_us(e) / 1e3
    sort_device = "self_device_time_total" if hasattr(prof.key_averages()[0], "self_device_time_total") \
        else "self_cuda_time_total"
    lines = [f"# {title}: {len(batches)} traced step(s), wall {wall_ms:.1f} ms ({wall_ms / max(len(batches), 1):.1f} ms/step)", ""]
    lines += [f"device time, {k}: {v:.1f} ms ({v / max(len(batches), 1):.1f} ms/step)" for k, v in kinds.items()]
    lines += ["", "## top operators by self CPU time",
              prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)]
    if torch.cuda.is_available():
        lines += ["", "## top operators and kernels by self device time",
                  prof.key_averages().table(sort_by=sort_device, row_limit=25, max_name_column_width=60)]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
