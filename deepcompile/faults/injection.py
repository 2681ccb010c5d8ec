"""Named points where a test can kill this process, to prove what survives a rank killed there.

``DC_TEST_KILL_AT=<point>[@<rank>]`` makes the process of that rank (default: every rank) send
itself SIGKILL when it reaches ``<point>``: no Python cleanup, no ``finally``, no atexit, as
when the kernel's OOM killer or a scheduler takes a node. The points are

* ``<phase>:<step>``: the engine entering a phase (``forward``, ``backward``, ``step``,
  ``save_checkpoint``, ``load_checkpoint``) at ``global_steps == step``, e.g. ``backward:3@1``
  (reported through the fault watchdog, so only while it runs);
* ``save:<point>``: inside ``save_checkpoint``'s commit protocol (checkpoint/dcp_checkpoint.py and
  layout.py name them: ``before_write``, ``after_write``, ``before_commit``, ``commit_aside``,
  ``before_latest``, ``latest_staged``).

Under torchrun only the first attempt is killed (``TORCHELASTIC_RESTART_COUNT`` 0), so that a
test of ``--max-restarts`` sees the restarted run go through. Without the variable
:func:`kill_point` is one comparison with None.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable, Optional, Tuple

ENV = "DC_TEST_KILL_AT"


def _parse(raw: Optional[str]) -> Optional[Tuple[str, Optional[int]]]:
    if not raw:
        return None
    point, _, rank = raw.strip().partition("@")
    return point, (int(rank) if rank else None)


_TARGET = _parse(os.environ.get(ENV))


def arm(spec: Optional[str]) -> None:
    """Name the point to kill at from inside the process (``spec`` as ``DC_TEST_KILL_AT``; None
    disarms): for a test whose process passes the point more than once and must die at a later pass."""
    global _TARGET
    _TARGET = _parse(spec)
    if spec:
        os.environ[ENV] = spec


def kill_point(point: str, rank: Optional[int] = None, before: Optional[Callable[[], None]] = None) -> None:
    """SIGKILL this process here if ``DC_TEST_KILL_AT`` names ``point`` (and this rank: ``rank``,
    else the ``RANK`` environment variable), after calling ``before`` (the fault watchdog
    publishes the phase the rank dies in). A no-op in production."""
    if _TARGET is None or _TARGET[0] != point:
        return
    if _TARGET[1] is not None and _TARGET[1] != (rank if rank is not None else int(os.environ.get("RANK", "0"))):
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    if before is not None:
        before()
    sys.stderr.write(f"deepcompile test hook: {ENV}={os.environ[ENV]}: killing this process (pid {os.getpid()}) "
                     f"at {point}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
