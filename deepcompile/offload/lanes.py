"""The two copy lanes of offloading: *reload* (host to device) and *offload* (device to host).

On CUDA each lane is a stream ordered against the compute stream (the stream current when a copy
is issued) with events. They are the C++ runtime's own offload and reload lanes
(csrc/include/deepcompile/lanes.h, through ``runtime.lane_stream``) whenever the runtime is
initialized on the GPU: the runtime's gathers read offloaded parameter shards from host memory,
and order themselves after the offload lane's write-backs into it. Without a runtime (or one for
another device) the lanes are streams of their own.

On a CPU device the lanes are the host itself: copies run synchronously on the caller, so there
is nothing to order.
"""

from __future__ import annotations

from typing import List, Optional

import torch


def _runtime_lanes(device: torch.device):
    """(reload, offload) streams of the C++ runtime on ``device``, or None."""
    from deepcompile import runtime

    if not runtime.is_initialized():
        return None
    reload, offload = runtime.lane_stream("reload"), runtime.lane_stream("offload")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not isinstance(reload, torch.cuda.Stream) or reload.device != torch.device("cuda", index):
        return None
    return reload, offload


class CopyLanes:
    def __init__(self, device: torch.device):
        self.device = device
        self.async_ = device.type == "cuda"
        self.shares_runtime_lanes = False
        if self.async_:
            lanes = _runtime_lanes(device)
            self.shares_runtime_lanes = lanes is not None
            if lanes is None:
                lanes = torch.cuda.Stream(device), torch.cuda.Stream(device)
            self.reload_stream, self.offload_stream = lanes

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

    def readers_done(self) -> List[torch.cuda.Event]:
        """Completion of everything queued so far that may read a host buffer: the copy lanes, the
        compute stream and the runtime's lanes (its gathers copy host shards on them). Empty on a
        CPU device, where copies are synchronous."""
        if not self.async_:
            return []
        streams = [torch.cuda.current_stream(self.device), self.reload_stream, self.offload_stream]
        if self.shares_runtime_lanes:
            from deepcompile import runtime

            streams += [runtime.lane_stream(lane) for lane in ("allgather", "reduce-scatter", "copy")]
        events = []
        for stream in streams:
            done = torch.cuda.Event()
            done.record(stream)
            events.append(done)
        return events

    def wait(self, event: Optional[torch.cuda.Event]) -> None:
        """The compute stream waits for ``event`` (no host synchronisation)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        if self.async_:
            self.reload_stream.synchronize()
            self.offload_stream.synchronize()
