"""Host-to-device copy bandwidth, measured once per process (bytes per second).

On CUDA: the median of a few 32 MiB copies from pinned host memory, timed with events on a side
stream. On a CPU device "the host" is other CPU memory: a memcpy of the same size, timed on the
wall clock. The activation-offload plan predicts transfer times from it and places reloads early
enough to hide them (passes/offload_activation.py).
"""

from __future__ import annotations

import statistics
import time
from typing import Dict

import torch

_MEASURED: Dict[str, float] = {}
_PROBE_BYTES = 32 << 20


def host_to_device_bytes_per_s(device: torch.device) -> float:
    key = str(device)
    if key not in _MEASURED:
        _MEASURED[key] = _measure_cuda(device) if device.type == "cuda" else _measure_cpu()
    return _MEASURED[key]


def _measure_cuda(device: torch.device) -> float:
    host = torch.empty(_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(_PROBE_BYTES, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    times = []
    with torch.cuda.stream(stream):
        for _ in range(4):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dev.copy_(host, non_blocking=True)
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return _PROBE_BYTES / max(statistics.median(times[1:]), 1e-9)


def _measure_cpu() -> float:
    src = torch.empty(_PROBE_BYTES, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return _PROBE_BYTES / max(min(times), 1e-9)
