"""Faults: no rank waits forever for a rank that failed (docs/faults.md).

* ``status``: what a rank publishes about itself, and how a peer judges it (plain data);
* ``watchdog``: :class:`FaultWatchdog`, the heartbeat and watch threads over the process
  group's store, and the exit when a peer failed;
* ``deadman``: the watchdog's exit of last resort, native timers that need no GIL;
* ``process_hooks``: ``sys.excepthook`` and ``atexit``, which tell the watchdogs how this process ends;
* ``injection``: :func:`kill_point`, SIGKILL at a named point for tests (``DC_TEST_KILL_AT``);
* ``restartable``: :func:`init_process_group`, a process group that a torchrun restart can rebuild.

:func:`watch_ranks` starts this rank's watchdog; the engine calls it at ``initialize``, tells it
each phase it enters and stops it at ``destroy()``.
"""

from __future__ import annotations

import uuid
import weakref
from typing import Any, Optional

import torch.distributed as dist

from deepcompile import compat
from deepcompile.faults import process_hooks
from deepcompile.faults.injection import kill_point
from deepcompile.faults.restartable import init_process_group
from deepcompile.faults.watchdog import PEER_FAILED_EXIT_CODE, FaultWatchdog, store_call_limit, store_connection

__all__ = ["FaultWatchdog", "PEER_FAILED_EXIT_CODE", "init_process_group", "kill_point", "stop_watching",
           "watch_ranks"]


def watch_ranks(settings, group: Optional[dist.ProcessGroup] = None, owner: Any = None) -> Optional[FaultWatchdog]:
    """Start this rank's watchdog over ``group``'s ranks (the default group: its store is the
    one reachable), with ``settings`` the config's ``fault_tolerance`` section. None when it is
    off or there is no other rank. Collective: the ranks agree on where their records live.

    The watchdog stops (as after a normal finish) when ``owner`` is garbage collected: an engine
    whose ``__init__`` raised, or one dropped without ``destroy()``, leaves no thread behind."""
    world_size = dist.get_world_size(group)
    if not settings.enabled or world_size == 1:
        return None
    # A fresh name per engine, from rank 0: records of an earlier engine on the same store (a
    # test process, a launcher's store kept across restarts) are never read as this one's.
    run_id = [uuid.uuid4().hex[:16] if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(run_id, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    watchdog = FaultWatchdog(store_connection(compat.default_store(), store_call_limit(settings.timeout_s)),
                             run_id[0], dist.get_rank(group), world_size, settings.timeout_s)
    process_hooks.register(watchdog)
    if owner is not None:
        weakref.finalize(owner, stop_watching, watchdog)
    return watchdog.start()


def stop_watching(watchdog: Optional[FaultWatchdog]) -> None:
    """This rank finished normally (``engine.destroy()``)."""
    if watchdog is not None:
        watchdog.stop()
        process_hooks.unregister(watchdog)
