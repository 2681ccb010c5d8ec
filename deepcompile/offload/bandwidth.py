"""Host-device copy bandwidth, measured once per device and process.

The offload planners predict transfer times from it (bytes / bandwidth): what a plan costs per
step, and how early a reload must start to be complete when needed. It is measured, not assumed,
because it varies by a factor of several between machines (PCIe generation, NUMA placement, pinned
or pageable buffers): pinned buffers of ``SIZE`` bytes, ``REPEATS`` timed copies per direction after
one untimed, CUDA events around them. A CPU device has no host-device link: None.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch

SIZE = 256 * 1024**2
REPEATS = 3


@dataclasses.dataclass(frozen=True)
class CopyBandwidth:
    host_to_device: float  # bytes per second
    device_to_host: float

    def seconds(self, to_device_bytes: int, to_host_bytes: int) -> float:
        """Time of these copies when the two directions overlap (each on its own lane)."""
        return max(to_device_bytes / self.host_to_device, to_host_bytes / self.device_to_host)


_measured: Dict[int, CopyBandwidth] = {}


def _time_copies(dst: torch.Tensor, src: torch.Tensor, stream: "torch.cuda.Stream") -> float:
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)  # untimed: first-touch and launch costs
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(REPEATS):
            dst.copy_(src, non_blocking=True)
        end.record(stream)
    end.synchronize()
    return REPEATS * src.numel() / (start.elapsed_time(end) / 1e3)


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
