"""What a rank publishes about itself, and how a peer judges it (plain data, no threads, no store).

Each rank keeps one record in the process group's store: its state, what it is doing (the
engine's phase and ``global_steps``), a heartbeat counter and where its process runs. A peer
never compares clocks across machines: it notes, on its own clock, when a rank's counter last
moved (:class:`PeerJudge`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from typing import Dict, Optional

ALIVE = "alive"  # beating; ``phase`` says what it is doing
FAILED = "failed"  # raised an exception nobody caught; ``error`` holds it
DONE = "done"  # finished normally (destroy() or interpreter exit): no longer watched
ABORTED = "aborted"  # exited because another rank failed; ``error`` holds that cause


@dataclasses.dataclass
class RankStatus:
    state: str
    phase: str
    step: int
    beat: int
    pid: int
    machine: str  # processes with the same machine id can see each other's pids ("" where unknown)
    error: str = ""

    def encode(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, raw) -> "RankStatus":
        text = raw.decode() if isinstance(raw, (bytes, bytearray)) else raw
        return cls(**json.loads(text))

    def doing(self) -> str:
        """``"backward of step 3"``: the step is the engine's ``global_steps`` when the phase began."""
        return f"{self.phase} of step {self.step}"


def machine_id() -> str:
    """Kernel boot id and pid namespace: two processes with the same value see the same pids, so
    one can tell whether the other's process still exists (a host name alone is not enough:
    containers on one host share it but not their pids). "" where /proc cannot tell."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{socket.gethostname()}/{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` (of this machine id) no longer runs: absent, or a zombie waiting to
    be reaped (a killed child of a launcher that has not collected it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    # "pid (command) state ...": the command may hold spaces and parentheses; the state follows the last ')'.
    fields = stat.rsplit(")", 1)[-1].split()
    return bool(fields) and fields[0] in ("Z", "X")


@dataclasses.dataclass
class _Seen:
    status: Optional[RankStatus]
    since: float  # this rank's clock when the heartbeat last moved (or when watching began)


class PeerJudge:
    """Decides, from successive readings of peers' records, which peer has failed and how.

    ``observe(rank, status, now)`` takes one reading (``status`` None: the rank has published
    nothing yet) and returns the cause to report, or None while the rank looks fine."""

    def __init__(self, timeout_s: float, started: float, machine: str):
        self.timeout_s = timeout_s
        self.started = started
        self.machine = machine
        self.seen: Dict[int, _Seen] = {}

    def last(self, rank: int) -> Optional[RankStatus]:
        seen = self.seen.get(rank)
        return None if seen is None else seen.status

    def observe(self, rank: int, status: Optional[RankStatus], now: float) -> Optional[str]:
        before = self.seen.get(rank)
        if before is None or (status is not None and (before.status is None or status.beat != before.status.beat)):
            self.seen[rank] = _Seen(status, now if status is not None else self.started)
        elif status is not None:
            before.status = status  # same beat: keep when it last moved
        seen = self.seen[rank]
        if status is None:
            if now - seen.since > self.timeout_s:
                return (f"rank {rank} never reported to the fault watchdog ({now - seen.since:.1f} s after this rank "
                        "started watching)")
            return None
        if status.state == FAILED:
            return f"rank {rank} failed during {status.doing()}: {status.error}"
        if status.state == ABORTED:
            return status.error or f"rank {rank} aborted during {status.doing()}"
        if status.state == DONE:
            return None
        if self.gone(rank):
            return (f"rank {rank} died during {status.doing()}: its process (pid {status.pid}) is gone without a "
                    "Python error (killed, or crashed in native code)")
        silent = now - seen.since
        if silent > self.timeout_s:
            return (f"rank {rank} stopped answering during {status.doing()}: no heartbeat for {silent:.1f} s "
                    f"(fault_tolerance.timeout_s is {self.timeout_s:g})")
        return None

    def gone(self, rank: int) -> bool:
        """Whether rank's process is known to be gone (same machine id only; False where unknown)."""
        status = self.last(rank)
        return (status is not None and bool(self.machine) and status.machine == self.machine
                and status.state not in (DONE,) and process_gone(status.pid))
