"""``fault_tolerance``: what a rank does when another rank fails (deepcompile's section; DeepSpeed
has no such key and leaves it to the collectives' own timeouts, 30 minutes by default).

The behaviour is ``deepcompile/faults/``'s and docs/faults.md's; this module only names the keys."""

from __future__ import annotations

import dataclasses

from deepcompile.config.schema import Section, key
from deepcompile.config.validators import boolean, number

DEFAULT_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class FaultToleranceConfig(Section):
    _path = "fault_tolerance"

    enabled: bool = key(
        boolean, True,
        "Watch the other ranks from initialize until destroy() or exit: when one raises, is killed or stops "
        "answering, every rank exits with an error naming it and what it was doing, instead of waiting in a "
        "collective that cannot finish. false: no watchdog (collectives wait as long as the process group's own "
        "timeout).")
    timeout_s: float = key(
        number(1.0), DEFAULT_TIMEOUT_S,
        "Seconds a rank may go without a heartbeat before the others give up on it and exit. A rank that raises "
        "or whose process is gone (same host) is reported at the next heartbeat, without waiting this long.")
