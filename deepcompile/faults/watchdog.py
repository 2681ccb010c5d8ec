"""The fault watchdog: every rank beats, watches a few peers, and exits when one has failed.

One thread per rank publishes this rank's record (``status.RankStatus``) in the process group's
store at every phase change and at least every ``interval`` seconds, and reads its peers'
records: the next ranks of the ring, and rank 0 (which serves the store in a plain ``env://``
launch). When it finds a peer that failed, died or fell silent for ``timeout_s``, it writes the
cause under one alarm key (the first cause written wins, so every rank reports the same root
cause), and every rank that reads the alarm exits with :data:`PEER_FAILED_EXIT_CODE` after one
line on stderr. ``os._exit`` is the only way out that works while the main thread waits inside
a collective that cannot complete. A second thread, which never touches the store, makes the
same exit when the store itself stops answering, and keeps re-arming a native deadline
(``deadman.py``) that makes it without Python if the main thread holds the GIL for good.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
from typing import Callable, List, Optional

from deepcompile.faults import deadman, injection
from deepcompile.faults.status import ABORTED, ALIVE, DONE, FAILED, PeerJudge, RankStatus, machine_id

# sysexits' EX_TEMPFAIL: this rank did nothing wrong, a restart may well succeed.
PEER_FAILED_EXIT_CODE = 75
KEY_ROOT = "deepcompile/faults/"
RING_NEIGHBOURS = 4  # each rank watches the next four ranks of the ring, and rank 0


def heartbeat_interval(timeout_s: float) -> float:
    """A tenth of the timeout, between 0.1 and 5 s: a beat lost to a busy host now and then is
    far from a timeout, and a large world does not flood the store."""
    return min(5.0, max(0.1, timeout_s / 10.0))


def store_call_limit(timeout_s: float) -> float:
    """How long one store call of the watchdog may block: two heartbeats, at least 2 s. The calls
    (set, check, get of a key known to exist, compare_set) are answered at once by a live server,
    so a call that takes longer means the server is gone or frozen, which the watchdog already
    judges by time since the last answer. The bound matters at exit: a watchdog thread still
    inside a store call when the interpreter finalizes aborts the whole process when the call
    returns (CPython ends such a thread with a forced unwind that C++ turns into
    ``std::terminate``), so the exit waits for these calls, and never for long."""
    return max(2.0, 2.0 * heartbeat_interval(timeout_s))


def native_deadline(timeout_s: float) -> float:
    """How long the watchdog may go without running before the native deadline ends the process:
    past the exit for a silent store (timeout plus two heartbeats) and the time that exit takes
    (a bounded store call and a heartbeat's wait, about two heartbeats and 1.5 s)."""
    return timeout_s + 2.0 * heartbeat_interval(timeout_s) + 2.0


def watched_ranks(rank: int, world_size: int) -> List[int]:
    ring = [(rank + i) % world_size for i in range(1, min(world_size - 1, RING_NEIGHBOURS) + 1)]
    return sorted(set(ring) | ({0} if rank != 0 else set()))


def first_line(error: BaseException, limit: int = 400) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    line = text[0] if text else type(error).__name__
    return line if len(line) <= limit else line[:limit] + " ..."


class FaultWatchdog:
    """This rank's heartbeat and its watch over peers. ``enter(phase, step)`` records what the
    rank is doing; ``stop()`` publishes that it finished normally. ``store`` should be a
    connection of its own (``Store.clone()``), so that a hung store call never holds the one the
    process group uses."""

    def __init__(self, store, run_id: str, rank: int, world_size: int, timeout_s: float,
                 exit_process: Callable[[int], None] = os._exit, stderr=None):
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.interval = heartbeat_interval(self.timeout_s)
        self.phase, self.step = "initialize", 0
        self._store = store
        self._prefix = f"{KEY_ROOT}{run_id}/"
        self._alarm_key = self._prefix + "alarm"
        self._exit_process = exit_process
        self._stderr = stderr
        self._machine = machine_id()
        self._judge = PeerJudge(self.timeout_s, time.monotonic(), self._machine)
        self._watched = watched_ranks(rank, world_size)
        self._state, self._error, self._beat = ALIVE, "", 0
        self._publish_lock = threading.Lock()
        self._abort_lock = threading.Lock()
        self._aborting = False
        self._wake = threading.Event()
        self._urgent = threading.Event()  # look at the peers at the next turn, not only every interval
        # Looks at the peers begun and completed: a caller waits for one that began after its request.
        self._looks_begun = self._looks_done = 0
        self._previous_sigterm, self._sigterm_installed = signal.SIG_DFL, False
        self._stopped = threading.Event()
        self._last_contact = time.monotonic()
        self._last_look = 0.0
        self._store_failing_since: Optional[float] = None
        self._threads = [threading.Thread(target=self._monitor, name=f"deepcompile-faults-r{rank}", daemon=True),
                         threading.Thread(target=self._deadline, name=f"deepcompile-faults-deadline-r{rank}",
                                          daemon=True)]

    # ---- the engine's side

    def start(self) -> "FaultWatchdog":
        self._publish()
        for t in self._threads:
            t.start()
        self._install_sigterm_handler()
        return self

    def enter(self, phase: str, step: int) -> None:
        """The rank now does ``phase`` (forward, backward, step, save_checkpoint, ...) of step
        ``step`` (the engine's global_steps). Published by the monitor thread, not here."""
        self.phase, self.step = phase, step
        self._wake.set()
        injection.kill_point(f"{phase}:{step}", self.rank, before=self._publish)

    def stop(self) -> None:
        """This rank finished normally: publish it (peers stop watching it) and end the threads.
        A rank that failed keeps its failure."""
        if self._stopped.is_set():
            return
        if self._state == ALIVE:
            self._state = DONE
            # The store may be gone or hung at exit; peers then see the process end instead.
            _bounded(self._publish, self.interval + 1.0)
        self._stopped.set()
        self._wake.set()
        # They wake at once, unless inside a store call: wait that out (bounded by the connection's
        # timeout, store_call_limit), so that no thread of ours is in native code at interpreter exit.
        limit = store_call_limit(self.timeout_s) + 1.0
        for t in self._threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(timeout=limit)
        join_store_calls(limit)
        self._restore_sigterm_handler()

    @property
    def running(self) -> bool:
        return not self._stopped.is_set()

    # ---- an uncaught exception on this rank (process_hooks.py)

    def on_uncaught(self, error: BaseException, symptom: bool) -> None:
        """This rank's main thread is dying of ``error``. A communication error is usually the
        echo of another rank's failure: give the watchdog up to the timeout to name that rank
        (it exits the process when it does). Otherwise, or if nothing turns up, publish this
        rank's own failure for the others to report."""
        if not self.running:
            return
        if symptom:
            self._say(f"rank {self.rank} got a communication error during {self._doing()} ({first_line(error, 200)}); "
                      f"waiting up to {self.timeout_s:g} s for the fault watchdog to find which rank failed")
            self.look_now()  # a killed peer's process is usually gone already: name it now, not an interval later
            deadline = time.monotonic() + self.timeout_s + 2 * self.interval
            while time.monotonic() < deadline and self.running:
                time.sleep(min(0.1, self.interval))
        if not self.running or self._aborting:
            return
        self._state, self._error = FAILED, first_line(error)
        # Where the store is gone, peers see the process end instead.
        _bounded(lambda: (self._publish(), self._raise_alarm(self._failure_cause())), self.interval + 1.0)

    def look_now(self) -> int:
        """Ask the monitor thread for a look at the peers at once; returns how many looks had
        begun, which :meth:`wait_for_look` takes."""
        begun = self._looks_begun
        self._urgent.set()
        self._wake.set()
        return begun

    def wait_for_look(self, begun: int, limit_s: float) -> bool:
        """Wait up to ``limit_s`` seconds for a look at the peers that began after ``begun`` looks
        had (it ends the process itself when it finds the failed rank); whether one completed."""
        deadline = time.monotonic() + limit_s
        while self._looks_done <= begun and time.monotonic() < deadline and self.running:
            time.sleep(0.02)
        return self._looks_done > begun

    def _install_sigterm_handler(self) -> None:
        """Name the failed rank before a launcher ends this process. torchrun's agent sends SIGTERM
        to every surviving worker a few milliseconds after it sees one fail (SIGKILL follows 30 s
        later) and restarts the job; Python's default SIGTERM dies at once, before any rank is
        named. The handler first gives the watchdog one fresh look at the peers (bounded: a store
        call and a heartbeat), which names the dead rank and exits as usual, and otherwise leaves
        as the previous handler would. Installed only over the default handler (a program's own
        handler is left alone) and only from the main thread (Python's rule). A main thread inside
        native code runs it when the call returns; until then the monitor thread, which looks at
        the peers every heartbeat anyway, names a dead rank and exits by itself."""
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
                return
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._sigterm_installed = True
        except (ValueError, OSError):  # not the main interpreter
            pass

    def _restore_sigterm_handler(self) -> None:
        if not self._sigterm_installed or threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
        except (ValueError, OSError):
            pass
        self._sigterm_installed = False

    def _on_sigterm(self, signum, frame) -> None:
        if self.running and not self._aborting:
            self.wait_for_look(self.look_now(), store_call_limit(self.timeout_s) + self.interval)
        if self._aborting:
            # The monitor named the failed rank and is on its way out (it stays an interval for
            # the peers to read the alarm): let it finish.
            self._stopped.wait(self.interval + 2.0)
            time.sleep(0.5)
            self._exit_process(PEER_FAILED_EXIT_CODE)
            return
        if self.running:
            self._say(f"rank {self.rank} (in {self._doing()}) was sent SIGTERM (its launcher ending the job); its fault "
                      "watchdog found no failed rank")
        previous = self._previous_sigterm
        self._restore_sigterm_handler()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            os.kill(os.getpid(), signal.SIGTERM)

    def linger(self) -> None:
        """Stay a moment after publishing a failure, so that peers read it before this process,
        which may serve the store, disappears."""
        if self._state == FAILED:
            time.sleep(self.interval + 0.5)

    # ---- the threads

    def _monitor(self) -> None:
        while not self._stopped.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stopped.is_set():
                return
            try:
                self._publish()
                cause = None
                if self._urgent.is_set() or time.monotonic() - self._last_look >= self.interval * 0.5:
                    self._urgent.clear()
                    self._looks_begun += 1
                    try:
                        cause = self._look()
                    finally:
                        self._looks_done += 1
                    self._last_look = time.monotonic()
                self._last_contact = time.monotonic()
                self._store_failing_since = None
            except Exception as e:  # noqa: BLE001  (the store did not answer)
                cause = self._store_trouble(e)
            if cause is not None and not self._stopped.is_set():
                self._abort(cause)

    def _deadline(self) -> None:
        """A store call that hangs instead of failing would silence the monitor: exit anyway. A
        main thread that holds the GIL in native code would silence this thread too: the native
        deadline (deadman.py), re-armed at every turn, then exits without it. Only where the
        exit is the process's own (a test's exit_process is not)."""
        native = None
        if self._exit_process is os._exit:
            span = native_deadline(self.timeout_s)
            native = deadman.NativeDeadline.create(
                f"deepcompile: rank {self.rank} exits with code {PEER_FAILED_EXIT_CODE}: its fault watchdog has not "
                f"run for {span:.1f} s, its main thread holding the GIL inside native code, so it cannot tell which "
                "rank failed (the others report this one as stopped answering). The C library's last error",
                PEER_FAILED_EXIT_CODE, span)
        try:
            while True:
                if native is not None:
                    native.arm()
                if self._stopped.wait(self.interval):
                    return
                silent = time.monotonic() - self._last_contact
                if silent > self.timeout_s + 2 * self.interval and not self._stopped.is_set():
                    cause = self._known_cause() or (f"the process group's store has not answered for {silent:.1f} s, "
                                                    f"{self._store_host_hint()}")
                    self._abort(cause)
        finally:
            if native is not None:
                native.close()

    # ---- store records

    def _key(self, rank: int) -> str:
        return f"{self._prefix}{rank}"

    def _record(self) -> RankStatus:
        return RankStatus(state=self._state, phase=self.phase, step=self.step, beat=self._beat, pid=os.getpid(),
                          machine=self._machine, error=self._error)

    def _publish(self) -> None:
        with self._publish_lock:
            self._beat += 1
            self._store.set(self._key(self.rank), self._record().encode())

    def _read(self, rank: int) -> Optional[RankStatus]:
        key = self._key(rank)
        if not self._store.check([key]):
            return None
        return RankStatus.decode(self._store.get(key))

    def _look(self) -> Optional[str]:
        """The cause to exit for, from the alarm or from the watched peers' records; None: all well."""
        if self._state != ALIVE:
            return None  # this rank failed itself: it leaves through its own exception
        if self._store.check([self._alarm_key]):
            return self._store.get(self._alarm_key).decode()
        for rank in self._watched:
            if self._judge.observe(rank, self._read(rank), time.monotonic()) is None:
                continue
            # Confirm with a fresh reading: a rank that finished (or failed) just before its process
            # ended says so itself.
            cause = self._judge.observe(rank, self._read(rank), time.monotonic())
            if cause is not None:
                return self._raise_alarm(cause)
        return None

    def _raise_alarm(self, cause: str) -> str:
        """Write ``cause`` under the alarm key unless a cause is there already; returns the one there."""
        held = self._store.compare_set(self._alarm_key, "", cause)
        held = held.decode() if isinstance(held, (bytes, bytearray)) else str(held)
        return held or cause

    def _failure_cause(self) -> str:
        return f"rank {self.rank} failed during {self._doing()}: {self._error}"

    def _doing(self) -> str:
        return f"{self.phase} of step {self.step}"

    # ---- the store fails

    def _known_cause(self) -> Optional[str]:
        """What the last readings and this machine's process table tell without the store."""
        for rank in self._watched:
            last = self._judge.last(rank)
            if last is None:
                continue
            if last.state in (FAILED, ABORTED):
                return self._judge.observe(rank, last, time.monotonic())
            if self._judge.gone(rank):
                return (f"rank {rank} died during {last.doing()}: its process (pid {last.pid}) is gone without a "
                        "Python error (killed, or crashed in native code)")
        return None

    def _store_host_hint(self) -> str:
        last = self._judge.last(0)
        where = f"; rank 0 was last seen in {last.doing()}" if last is not None and self.rank != 0 else ""
        return f"so whoever serves it (rank 0's process in an env:// launch, else the launcher) is probably gone{where}"

    def _store_trouble(self, error: BaseException) -> Optional[str]:
        now = time.monotonic()
        if self._store_failing_since is None:
            self._store_failing_since = now
        if any((s := self._judge.last(r)) is not None and s.state == DONE for r in self._watched):
            # The job is ending: a rank that finished took the store down with it. Nothing to watch.
            self._stopped.set()
            return None
        cause = self._known_cause()
        if cause is not None:
            return cause
        if now - self._store_failing_since > self.timeout_s:
            return (f"the process group's store has failed for {now - self._store_failing_since:.1f} s "
                    f"({first_line(error, 200)}), {self._store_host_hint()}")
        return None

    # ---- leaving

    def _say(self, line: str) -> None:
        stream = self._stderr or sys.stderr
        try:
            stream.write(f"deepcompile: {line}\n")
            stream.flush()
        except Exception:  # noqa: BLE001
            pass

    def _abort(self, cause: str) -> None:
        with self._abort_lock:
            if self._aborting or self._state != ALIVE:
                return
            self._aborting = True
        doing = self._doing()
        self._state, self._error = ABORTED, cause
        # The store may be what failed: do not wait for it.
        _bounded(lambda: (self._publish(), self._raise_alarm(cause)), self.interval + 1.0)
        self._say(f"{cause}. Rank {self.rank} (in {doing}) exits with code {PEER_FAILED_EXIT_CODE} rather than wait "
                  "for it in a collective that cannot complete.")
        # Peers poll every interval: stay that long, so that they read the alarm from a store this
        # process may be serving.
        time.sleep(self.interval + 0.5)
        self._stopped.set()
        self._exit_process(PEER_FAILED_EXIT_CODE)


def _bounded(action: Callable[[], object], limit_s: float) -> bool:
    """Run ``action`` (store calls) for at most ``limit_s`` seconds, in a thread of its own: a
    store whose server is frozen can block a call without end, and the exit must not wait for it.
    Errors are swallowed (the store may be what failed). Whether it finished."""

    def run():
        try:
            action()
        except Exception:  # noqa: BLE001
            pass

    worker = threading.Thread(target=run, name="deepcompile-faults-store", daemon=True)
    with _STORE_CALLS_LOCK:
        _STORE_CALLS.append(worker)
    worker.start()
    worker.join(limit_s)
    return not worker.is_alive()


# The threads _bounded left behind in a store call that outlasted its limit: the exit still waits
# for them (join_store_calls), for the reason store_call_limit gives.
_STORE_CALLS: List[threading.Thread] = []
_STORE_CALLS_LOCK = threading.Lock()


def join_store_calls(limit_s: float) -> bool:
    """Wait up to ``limit_s`` seconds in all for every store call _bounded started to return.
    Whether none is left."""
    deadline = time.monotonic() + limit_s
    with _STORE_CALLS_LOCK:
        pending = [t for t in _STORE_CALLS if t.is_alive()]
        _STORE_CALLS[:] = pending
    for worker in pending:
        if worker is not threading.current_thread():
            worker.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in pending)


def store_connection(store, timeout_s: float):
    """A connection of the watchdog's own to ``store`` where the store can make one (TCPStore),
    with calls that give up after ``timeout_s`` (``store_call_limit``); else ``store`` itself."""
    try:
        own = store.clone()
    except Exception:  # noqa: BLE001  (FileStore, HashStore: no second connection; share it)
        return store
    try:
        own.set_timeout(datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001
        pass
    return own
