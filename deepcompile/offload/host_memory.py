"""Host buffers that hold offloaded tensors.

Pinned (page-locked) buffers let the device copy asynchronously, overlapped with compute; pageable
ones make every copy synchronous with the host. Pinning needs a CUDA host, so it applies to CUDA
devices only: on a CPU device a buffer is ordinary memory (a storage of its own, apart from the
"device" copy).

Pinned buffers come from the extension (``_C.pinned_host_buffer``), exactly the size asked for,
not from torch's pinned allocator: that one rounds every block up to a power of two, so a 7B
model's offloaded state (Adam moments of 4096 x 11008 weights: 180 MB each, 256 MiB blocks) would
pin about a third more host memory than it holds, the difference between a 40-layer model fitting
in a machine's memory or not. An offload buffer lives as long as its engine, so that allocator's
caching would not help either. ``DC_OFFLOAD_PINNED_ALLOCATOR=torch`` selects torch's allocator
instead, for side-by-side measurements.
"""

from __future__ import annotations

import os

import torch


class PinnedMemoryError(RuntimeError):
    """Page-locked host memory for an offload buffer could not be allocated."""


def empty_host(nbytes: int, pin: bool) -> torch.Tensor:
    """An uninitialised host buffer of exactly ``nbytes`` bytes (uint8), page-locked when ``pin``."""
    try:
        if pin and os.environ.get("DC_OFFLOAD_PINNED_ALLOCATOR") == "torch":
            # For A/B measurements only: torch's (rounding, caching) pinned allocator.
            return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)
        if pin:
            from deepcompile import _C

            return _C.pinned_host_buffer(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu")
    except RuntimeError as e:
        kind = "pinned" if pin else "pageable"
        raise PinnedMemoryError(f"could not allocate {nbytes} bytes of {kind} host memory: {e}") from e
