"""Host-device copy bandwidth, measured once per device and process.

The offload planners predict transfer times from it (bytes / bandwidth): what the optimizer-state
plan costs per step (``opt_states.py``), and how early an activation's reload must start to be
complete when the backward needs it (``passes/offload_activation.py``). It is measured, not
assumed, because it varies by a factor of several between machines (PCIe generation, NUMA
placement): pinned buffers of ``SIZE`` bytes, ``REPEATS`` timed copies per direction after one
untimed, CUDA events around them. On a CPU device "the host" is other CPU memory: the activation
planner gets a memcpy's rate (wall clock), the optimizer-state report no link (None).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, Optional

import torch

SIZE = 256 * 1024**2
REPEATS = 3
_CPU_PROBE = 32 * 1024**2


@dataclasses.dataclass(frozen=True)
class CopyBandwidth:
    host_to_device: float  # bytes per second
    device_to_host: float

    def seconds(self, to_device_bytes: int, to_host_bytes: int) -> float:
        """Time of these copies when the two directions overlap (each on its own lane)."""
        return max(to_device_bytes / self.host_to_device, to_host_bytes / self.device_to_host)


_measured: Dict[int, CopyBandwidth] = {}
_cpu_rate: Optional[float] = None


def _time_copies(dst: torch.Tensor, src: torch.Tensor, stream: "torch.cuda.Stream") -> float:
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)  # untimed: first-touch and launch costs
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(REPEATS):
            dst.copy_(src, non_blocking=True)
        end.record(stream)
    end.synchronize()
    return REPEATS * src.numel() / max(start.elapsed_time(end) / 1e3, 1e-9)


def copy_bandwidth(device: torch.device) -> Optional[CopyBandwidth]:
    """The measured pinned copy bandwidth of ``device`` (cached); None on a CPU device."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _measured:
        host = torch.empty(SIZE, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(SIZE, dtype=torch.uint8, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        h2d = _time_copies(dev, host, stream)
        d2h = _time_copies(host, dev, stream)
        dev.record_stream(stream)
        _measured[index] = CopyBandwidth(h2d, d2h)
    return _measured[index]


def host_to_device_bytes_per_s(device: torch.device) -> float:
    """Host-to-device rate of ``device``; on a CPU device, a memcpy's rate (fastest of three)."""
    link = copy_bandwidth(device)
    if link is not None:
        return link.host_to_device
    global _cpu_rate
    if _cpu_rate is None:
        src = torch.empty(_CPU_PROBE, dtype=torch.uint8)
        dst = torch.empty_like(src)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        _cpu_rate = _CPU_PROBE / max(min(times), 1e-9)
    return _cpu_rate
