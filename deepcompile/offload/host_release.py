"""Host buffers let go of once nothing can still read them.

When the offload plan keeps a unit on the device, its host buffer (allocated when the unit went to
the host provisionally: parameter offload's masters at ``initialize``, state a streamed step just
created) has no use any more and is released, so host memory holds only what is offloaded. On a
GPU, copies queued before the release may still read the buffer: the reload that brought the unit
back, and the runtime's gathers of a master's host shard, which run on its own lanes. Page-locked
buffers from ``_C.pinned_host_buffer`` are freed with ``cudaFreeHost`` when their last reference
goes, which nothing orders after those copies; so each buffer is kept until events recorded on
every stream that may read it (``CopyLanes.readers_done``) have completed, checked without waiting
at the next hook of the step. On a CPU device copies are synchronous and the buffer goes at once.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import torch


class HostReleases:
    def __init__(self):
        self._pending: List[Tuple[torch.Tensor, List[Any]]] = []

    def release(self, buffer: torch.Tensor, readers_done: List[Any]) -> None:
        """Drop ``buffer`` once every event of ``readers_done`` has completed (at once if none)."""
        if readers_done:
            self._pending.append((buffer, readers_done))

    def poll(self) -> None:
        """Drop the buffers whose readers are done; never waits."""
        if self._pending:
            self._pending = [(b, events) for b, events in self._pending if not all(e.query() for e in events)]

    def drain(self) -> None:
        """Wait for every pending reader and drop all buffers (engine teardown)."""
        for _, events in self._pending:
            for e in events:
                e.synchronize()
        self._pending = []

    @property
    def nbytes(self) -> int:
        """Bytes still held for pending releases."""
        return sum(b.numel() * b.element_size() for b, _ in self._pending)
