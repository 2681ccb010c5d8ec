"""Moving units' bytes between the device and their host buffers (``units.py``).

Copies run on two lanes (``lanes.py``): an offload copies the device storage to the unit's host
buffer and frees the storage at once (the allocator is told the offload lane still reads it); a
reload re-allocates the storage in place on the compute stream and copies the bytes back after
the last offload, so the values are bitwise those written. A unit whose host copy is current (a
frozen parameter's shard, state of a parameter the step skipped) goes without a copy.

Parameter offload: a ZeRO-3 master unit is what the runtime gathers from, so its gathers are
pointed at the host copy while it is there and back at the device shard once a reload is waited
for. Host buffers of units the plan keeps resident are released once nothing can read them
(``host_release.py``).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from deepcompile.offload import host_memory
from deepcompile.offload.host_release import HostReleases
from deepcompile.offload.lanes import CopyLanes
from deepcompile.offload.units import MASTER, OffloadUnit, Residence


class UnitCopies:
    """``offload_masters``: master units are parameter shards the runtime gathers from;
    ``label``: a unit in words, for the failure a host buffer allocation reports."""

    def __init__(self, device: torch.device, pin_memory: bool, offload_masters: bool,
                 label: Callable[[OffloadUnit], str]):
        self.lanes = CopyLanes(device)
        self.releases = HostReleases()  # host buffers of units the plan keeps resident
        self.pin_memory = pin_memory
        self.offload_masters = offload_masters
        self._label = label
        # The first host buffer that could not be allocated since the last take_failure(): raised
        # on every rank by the next collective decision, never on one rank alone.
        self._failure: Optional[str] = None

    # ---- host buffers -------------------------------------------------------------------------

    def ensure_host(self, unit: OffloadUnit) -> bool:
        """``unit`` has a host buffer (allocated now if needed); False (and the failure noted for
        ``take_failure``) when it cannot get one."""
        if unit.host is not None and unit.host.numel() == unit.nbytes:
            return True
        try:
            unit.host = host_memory.empty_host(unit.nbytes, self.pin_memory)
            return True
        except host_memory.PinnedMemoryError as e:
            self._failure = self._failure or f"{self._label(unit)}: {e}"
            return False

    def take_failure(self) -> Optional[str]:
        failure, self._failure = self._failure, None
        return failure

    def release_host(self, unit: OffloadUnit) -> None:
        """``unit`` stays on the device: its host buffer goes, so host memory holds only offloaded
        units. A master's gathers read the device copy from now on. A later plan that offloads the
        unit again allocates a fresh buffer (``ensure_host``)."""
        self.arrived(unit)  # the compute stream (and the gathers after it) see the reload
        # Recorded after the hand-back: every read of the host copy was queued before these events.
        self.releases.release(unit.host, self.lanes.readers_done())
        unit.host, unit.written, unit.residence = None, None, Residence.DEVICE

    def host_bytes(self, units: Iterable[OffloadUnit]) -> int:
        """Host memory held: the units' buffers, and those whose release waits for copies still
        reading them."""
        return sum(u.host.numel() for u in units if u.host is not None) + self.releases.nbytes

    # ---- copies -------------------------------------------------------------------------------

    def offload(self, unit: OffloadUnit) -> None:
        if unit.residence is Residence.HOST:
            return
        if unit.residence is Residence.DEVICE_HOST_CURRENT:
            # Unchanged since it came back: the host already has these bytes; only the device copy
            # goes. It may be freed once the compute stream is past its reload.
            self.lanes.wait(unit.reloading)
            unit.reloading = None
        else:
            unit.written = self.lanes.offload(unit.host, unit.device_bytes)
        self.hand_gathers(unit, to_host=True)
        unit.device_bytes.untyped_storage().resize_(0)
        unit.residence = Residence.HOST

    def reload(self, unit: OffloadUnit) -> None:
        if unit.residence is not Residence.HOST:
            return
        # Allocated on the compute stream, where the step will use it.
        unit.device_bytes.untyped_storage().resize_(unit.nbytes)
        unit.reloading = self.lanes.reload(unit.device_bytes, unit.host, unit.written)
        unit.residence = Residence.DEVICE_HOST_CURRENT

    def arrived(self, unit: OffloadUnit) -> None:
        """The compute stream waits for ``unit``'s reload (if one is in flight), and its gathers
        read the device shard again."""
        self.lanes.wait(unit.reloading)
        unit.reloading = None
        self.hand_gathers(unit, to_host=False)

    def settle(self, unit: OffloadUnit) -> None:
        """No copy into or out of ``unit``'s host buffer is in flight: its offload is complete
        (a reader would see half-written bytes, a writer would be overwritten by the copy), and a
        reload of it is complete and its gathers point back at the device shard (a write to the
        device copy must be what the next gather reads). Host synchronisation: outside a step."""
        if unit.written is not None:
            unit.written.synchronize()
            unit.written = None
        if unit.reloading is not None:
            unit.reloading.synchronize()
            unit.reloading = None
            self.hand_gathers(unit, to_host=False)

    def hand_gathers(self, unit: OffloadUnit, to_host: bool) -> None:
        """Parameter offload: point a master unit's gathers (under ZeRO-3 one parameter's shard
        storage) at the host copy while it is there, back at the device shard once the reload is
        waited for (the runtime orders host reads after the offload lane's copies)."""
        if not (self.offload_masters and unit.what == MASTER):
            return
        from deepcompile import runtime

        if not to_host and not runtime.is_initialized():
            return  # the runtime is gone (engine teardown): no gather to point back
        for ds_id in unit.ds_ids:
            host = None
            if to_host:
                shard = runtime.registered_shard(ds_id)
                start = shard.storage_offset()
                host = unit.host.view(shard.dtype)[start: start + shard.numel()]
            runtime.set_host_shard(ds_id, host)
