"""A surviving rank that torchrun's agent ends with SIGTERM after another rank died (tests/faults).

``python sigterm_survivor.py KIND WHERE``: a fault watchdog for rank 0 of 2 over a HashStore
(timeout 30 s: a heartbeat interval of 3 s, longer than the test waits), while a second thread
plays the launcher: it writes rank 1's record, then sends this process SIGTERM 50 ms later, as
torchrun's agent does when it has seen rank 1 fail. KIND ``dead``: rank 1's record names a
process that has ended (killed); ``alive``: this process's own pid (nobody to name). WHERE
``waiting``: the main thread died of a communication error and waits for the watchdog
(``process_hooks`` calls ``on_uncaught``); ``busy``: the SIGTERM comes first, while the main
thread still works (the collective has not failed yet).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import torch.distributed as dist

from deepcompile.faults.status import RankStatus, machine_id
from deepcompile.faults.watchdog import FaultWatchdog


def main(kind: str, where: str) -> None:
    store = dist.HashStore()
    watchdog = FaultWatchdog(store, "sigterm", 0, 2, 30.0).start()
    watchdog.enter("backward", 3)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    pid = ended.pid if kind == "dead" else os.getpid()
    record = RankStatus(state="alive", phase="backward", step=3, beat=1, pid=pid, machine=machine_id(), error="")

    def launcher():
        time.sleep(0.5)  # the main thread is in its wait by now, and the watchdog has looked once
        store.set("deepcompile/faults/sigterm/1", record.encode())
        time.sleep(0.05)
        os.kill(os.getpid(), 15)

    threading.Thread(target=launcher, daemon=True).start()
    if where == "waiting":
        watchdog.on_uncaught(RuntimeError("Connection closed by peer [127.0.0.1]:1234"), symptom=True)
    else:
        time.sleep(10.0)
    print("survivor: the wait ended without an exit", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
