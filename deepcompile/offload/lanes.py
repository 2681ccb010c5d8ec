"""The two copy lanes of offloading: *reload* (host to device) and *offload* (device to host).

On CUDA each lane is a dedicated ``torch.cuda.Stream``, ordered against the compute stream (the
stream current when a copy is issued) with events. The C++ runtime reserves an offload and a
reload lane in its stream manager (csrc/include/deepcompile/lanes.h), but no op exposes them to
Python yet; when graph passes issue offload work (parameter and activation offload), that work
belongs on those lanes and this class is where optimizer-state copies would move over.

On a CPU device the lanes are the host itself: copies run synchronously on the caller, so there
is nothing to order.
"""

from __future__ import annotations

from typing import Optional

import torch


class CopyLanes:
    def __init__(self, device: torch.device):
        self.device = device
        self.async_ = device.type == "cuda"
        if self.async_:
            self.reload_stream = torch.cuda.Stream(device)
            self.offload_stream = torch.cuda.Stream(device)

    def offload(self, host: torch.Tensor, dev: torch.Tensor) -> Optional[torch.cuda.Event]:
        """Copy ``dev`` into ``host`` after the compute issued so far (the optimizer step that
        wrote it). ``dev``'s memory may be freed right after the call: the allocator is told
        the offload lane still reads it. Returns the copy's completion (None: already done)."""
        if not self.async_:
            host.copy_(dev)
            return None
        self.offload_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.offload_stream):
            host.copy_(dev, non_blocking=True)
        dev.record_stream(self.offload_stream)
        done = torch.cuda.Event()
        done.record(self.offload_stream)
        return done

    def reload(self, dev: torch.Tensor, host: torch.Tensor,
               written: Optional[torch.cuda.Event]) -> Optional[torch.cuda.Event]:
        """Copy ``host`` into ``dev`` (just allocated on the compute stream) once ``written`` (the
        last offload into ``host``) is complete. Returns the copy's completion."""
        if not self.async_:
            dev.copy_(host)
            return None
        # The allocator may hand out a block the compute stream used until now: the copy must not
        # overwrite it before that work is done.
        self.reload_stream.wait_stream(torch.cuda.current_stream(self.device))
        if written is not None:
            self.reload_stream.wait_event(written)
        with torch.cuda.stream(self.reload_stream):
            dev.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.reload_stream)
        return done

    def wait(self, event: Optional[torch.cuda.Event]) -> None:
        """The compute stream waits for ``event`` (no host synchronisation)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        if self.async_:
            self.reload_stream.synchronize()
            self.offload_stream.synchronize()
