"""The exit of last resort: one that needs neither the GIL nor any Python thread.

The fault watchdog's threads are Python: they run whenever the main thread releases the GIL, and
every wait of torch, CUDA, NCCL and deepcompile's runtime does release it. A main thread that
holds the GIL inside native code (a C extension's blocking call that does not release it) starves
them instead. The other ranks then give this rank up as stopped answering and leave; this one,
unable to run a line of Python, would wait for ever if what it waits for is a rank that failed.

:class:`NativeDeadline` holds two POSIX timers (``timer_create`` with ``SIGEV_THREAD``: the C
library runs an expiry in a native thread of its own). The watchdog re-arms them at every turn
of its loop, so they expire only when it has not run for the whole span: the first prints one
line on stderr (``perror``: the C library appends its last error, normally "Success"), the second,
a moment later, calls ``_exit`` with the watchdog's exit code. Each C function takes its one
argument from the timer's ``sigval``, which the calling convention passes in the first argument
register on x86-64 and aarch64 Linux; elsewhere, or where the C library lacks the calls, there is
no native deadline (:meth:`NativeDeadline.create` returns None) and such a rank waits as before.
"""

from __future__ import annotations

import ctypes
import platform
import sys
from typing import Optional

_SIGEV_THREAD = 2
_CLOCK_MONOTONIC = 1
# Between the line and the exit: time for the line's thread to write it before the process ends.
LINE_LEAD_S = 0.3


class _SigEvent(ctypes.Structure):
    # struct sigevent of Linux (64 bytes): sigval, signo, notify, then the SIGEV_THREAD members.
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("function", ctypes.c_void_p), ("attributes", ctypes.c_void_p), ("_pad", ctypes.c_int * 8)]


class _TimeSpec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class _ITimerSpec(ctypes.Structure):
    _fields_ = [("interval", _TimeSpec), ("value", _TimeSpec)]


def _spec(seconds: float) -> _ITimerSpec:
    whole = int(seconds)
    return _ITimerSpec(interval=_TimeSpec(0, 0), value=_TimeSpec(whole, int((seconds - whole) * 1e9)))


def supported() -> bool:
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")


class NativeDeadline:
    """``arm()`` (re)starts the span; ``close()`` removes the timers. One thread uses it."""

    def __init__(self, libc, line: bytes, exit_code: int, span_s: float):
        self._libc = libc
        self._line = ctypes.create_string_buffer(line)  # perror reads it when the timer fires: kept alive here
        self.span_s = span_s
        self._timers = []
        try:
            self._timers.append(self._timer(libc.perror, ctypes.addressof(self._line)))
            self._timers.append(self._timer(libc._exit, exit_code))
        except Exception:
            self.close()
            raise

    @classmethod
    def create(cls, line: str, exit_code: int, span_s: float) -> Optional["NativeDeadline"]:
        """None where this platform has no such timers."""
        if not supported():
            return None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.timer_create.argtypes = [ctypes.c_int, ctypes.POINTER(_SigEvent), ctypes.POINTER(ctypes.c_void_p)]
            libc.timer_settime.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_ITimerSpec), ctypes.c_void_p]
            libc.timer_delete.argtypes = [ctypes.c_void_p]
            return cls(libc, line.encode(errors="replace"), exit_code, span_s)
        except Exception:  # noqa: BLE001  (no such timers here: the watchdog runs on without them)
            return None

    def _timer(self, function, argument: int) -> ctypes.c_void_p:
        event = _SigEvent(value=argument, signo=0, notify=_SIGEV_THREAD,
                          function=ctypes.cast(function, ctypes.c_void_p).value)
        timer = ctypes.c_void_p()
        if self._libc.timer_create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
            raise OSError(ctypes.get_errno(), "timer_create")
        return timer

    def arm(self) -> None:
        for timer, after in zip(self._timers, (self.span_s, self.span_s + LINE_LEAD_S)):
            self._libc.timer_settime(timer, 0, ctypes.byref(_spec(after)), None)

    def close(self) -> None:
        # Deleting a timer disarms it.
        for timer in self._timers:
            self._libc.timer_delete(timer)
        self._timers = []
