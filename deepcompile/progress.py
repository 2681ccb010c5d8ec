"""Lines that say a long operation is still running: the first compile, a checkpoint save or load.

A first compile of a large model, or a checkpoint of tens of GiB, can take minutes with nothing on
the screen; a user cannot tell a slow step from a hang. :func:`long_operation` logs (INFO, rank 0
only: the caller passes ``show``) one line when the operation starts, one every ``every_s``
seconds while it runs ("... still running after 60 s"), from a daemon thread that only sleeps
and logs, and one when it ends with its duration. Nothing is synchronised and nothing of the
operation is touched: the heartbeat is only a clock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Dict, Iterator, Optional, Set

log = logging.getLogger("deepcompile")

HEARTBEAT_S = 30.0


class _Heartbeat(threading.Thread):
    def __init__(self, what: str, every_s: float, started: float):
        super().__init__(name="deepcompile-progress", daemon=True)
        self.what, self.every_s, self.started = what, every_s, started
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            log.info("%s: still running after %.0f s", self.what, time.perf_counter() - self.started)


@contextlib.contextmanager
def long_operation(what: str, show: bool, every_s: float = HEARTBEAT_S,
                   quiet_under_s: Optional[float] = None) -> Iterator[Dict[str, str]]:
    """Log ``what`` when it starts, every ``every_s`` seconds while it runs and when it ends, if
    ``show`` and INFO is enabled. Yields a dict the body may fill with ``done``, the end line's
    words (default "<what>: done"), followed by the duration. An operation that raises gets no
    end line: its exception says what happened. ``quiet_under_s``: for an operation that is
    usually quick, no start line, and an end line only if it took at least that long."""
    info = {"done": f"{what}: done"}
    if not show or not log.isEnabledFor(logging.INFO):
        yield info
        return
    started = time.perf_counter()
    if quiet_under_s is None:
        log.info("%s ...", what)
    beat = _Heartbeat(what, every_s, started)
    beat.start()
    try:
        yield info
    finally:
        beat.done.set()
    elapsed = time.perf_counter() - started
    if quiet_under_s is None or elapsed >= quiet_under_s:
        log.info("%s in %.1f s", info["done"], elapsed)


class FirstRuns:
    """Announces the first run of each phase ("forward", "backward") of a compiled module: that is
    when torch.compile traces and compiles, lazily, and a large model may take minutes. ``reset``
    (after a plan change that compiles again) announces the next runs again."""

    def __init__(self, show: bool):
        self.show = show
        self._seen: Set[str] = set()
        self._round = 0

    def reset(self) -> None:
        self._seen = set()
        self._round += 1

    def __call__(self, phase: str, compiled: bool):
        if not compiled or phase in self._seen:
            return contextlib.nullcontext({})
        self._seen.add(phase)
        if self._round == 0:
            return long_operation(f"first compile: tracing and compiling the {phase}", self.show)
        # After a plan change only the graphs it changed compile again, often none: said only if slow.
        return long_operation(f"compiling the {phase} for the new schedule", self.show, quiet_under_s=1.0)
