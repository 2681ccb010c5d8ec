"""The process-wide hooks that tell the fault watchdogs how this process ends.

* ``sys.excepthook`` (an exception nobody caught): each live watchdog publishes the failure, so
  the other ranks exit naming this rank at once rather than after the timeout; a communication
  error is first given time to be traced to the rank that caused it (:func:`is_symptom`).
* ``atexit`` (a normal exit without ``engine.destroy()``): each live watchdog publishes "done",
  so that ranks finishing a few seconds apart raise no alarm.

Installed once, at the first watchdog; the hooks found then are called after ours.
"""

from __future__ import annotations

import atexit
import sys
import threading
from typing import List

import torch.distributed as dist

from deepcompile.faults.watchdog import FaultWatchdog

_LIVE: List[FaultWatchdog] = []
_LOCK = threading.Lock()
_installed = False
_previous_excepthook = sys.excepthook

# What collectives raise when a peer is gone: gloo's socket errors arrive as plain RuntimeErrors.
_SYMPTOM_TEXT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
                 "Socket Timeout", "Timed out waiting", "NCCL error", "ProcessGroupNCCL", "ProcessGroupGloo")


def is_symptom(error: BaseException) -> bool:
    """Whether ``error`` is what a collective raises when another rank failed (a
    ``torch.distributed.DistError``, or a socket error from gloo), anywhere in its chain."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, dist.DistError) or any(text in str(error) for text in _SYMPTOM_TEXT):
            return True
        error = error.__cause__ or error.__context__
    return False


def register(watchdog: FaultWatchdog) -> None:
    global _installed, _previous_excepthook
    with _LOCK:
        if not _installed:
            _previous_excepthook = sys.excepthook
            sys.excepthook = _excepthook
            atexit.register(_at_exit)
            _installed = True
        _LIVE.append(watchdog)


def unregister(watchdog: FaultWatchdog) -> None:
    with _LOCK:
        if watchdog in _LIVE:
            _LIVE.remove(watchdog)


def _excepthook(exc_type, error, tb) -> None:
    live = [w for w in list(_LIVE) if w.running]
    symptom = is_symptom(error)
    for watchdog in live:
        watchdog.on_uncaught(error, symptom)  # may end the process (another rank was the cause)
    _previous_excepthook(exc_type, error, tb)
    for watchdog in live:
        watchdog.linger()


def _at_exit() -> None:
    for watchdog in list(_LIVE):
        watchdog.stop()
        unregister(watchdog)
