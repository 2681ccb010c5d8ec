"""Host buffers that hold offloaded tensors.

Pinned (page-locked) buffers let the device copy asynchronously, overlapped with compute; pageable
ones make every copy synchronous with the host. Pinning needs a CUDA host, so it applies to CUDA
devices only: on a CPU device a buffer is ordinary memory (a storage of its own, apart from the
"device" copy).
"""

from __future__ import annotations

import torch


class PinnedMemoryError(RuntimeError):
    """Page-locked host memory for an offload buffer could not be allocated."""


def empty_host(nbytes: int, pin: bool) -> torch.Tensor:
    """An uninitialised host buffer of ``nbytes`` bytes (uint8), page-locked when ``pin``."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
    except RuntimeError as e:
        kind = "pinned" if pin else "pageable"
        raise PinnedMemoryError(f"could not allocate {nbytes} bytes of {kind} host memory: {e}") from e
