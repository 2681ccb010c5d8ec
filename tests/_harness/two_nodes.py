"""Two torchrun launchers on this host acting as the two nodes of one job.

What a multi-node user runs, minus the second machine: each launcher is started as on its own
node (``--nnodes 2 --node-rank k``) and the two meet through a c10d rendezvous on localhost::

    python -m torch.distributed.run --nnodes 2 --node-rank K --nproc-per-node P \\
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID SCRIPT ARGS

With c10d the rendezvous, not ``--node-rank``, numbers the nodes; the flag is passed as users
pass it. Node 0's launcher is told to host the rendezvous store (``is_host=1``) and node 1's not,
which on one host would otherwise be decided by a race between the two (both match the
endpoint's address).

Failures end quickly and leave nothing behind: as soon as one launcher exits with an error, or
the deadline passes, every process of the job is killed, the launchers' process groups and each
worker (torchrun starts its workers in sessions of their own, so killing a launcher's group does
not reach them; they are found through /proc while the job runs, and once more before the kill).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Dict, List, Optional, Sequence, Set

from _harness.paths import ROOT, TESTS

NODES = 2
# How long a launcher waits for the other one to join the rendezvous before giving up.
JOIN_TIMEOUT_S = 60
_POLL_S = 0.5


class LaunchFailure(AssertionError):
    """A launcher failed or the job ran past its deadline; the message holds both launchers' output."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The test process's environment, with the repository and tests/ importable (the worker
    imports ``_harness``) and loopback for gloo."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def launcher_command(node_rank: int, nproc_per_node: int, endpoint: str, run_id: str, script: str,
                     args: Sequence[str]) -> List[str]:
    conf = f"join_timeout={JOIN_TIMEOUT_S},is_host={1 if node_rank == 0 else 0}"
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--node-rank", str(node_rank),
            "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id, "--rdzv-conf", conf, "--max-restarts", "0", "--monitor-interval", "0.5",
            script, *args]


def children_by_parent() -> Dict[int, List[int]]:
    table: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # ended while listing
        # The command name (2nd field) is in parentheses and may hold spaces; the parent pid is
        # the second field after it.
        table.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    return table


def descendants(pid: int) -> List[int]:
    table, found, todo = children_by_parent(), [], [pid]
    while todo:
        for child in table.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def is_running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class TwoNodeJob:
    """Start both launchers at once; :meth:`wait` returns their outputs or raises
    :class:`LaunchFailure`, and in every case leaves no process of the job running."""

    def __init__(self, script: str, args: Sequence[str], nproc_per_node: int = 2,
                 env: Optional[Dict[str, str]] = None) -> None:
        self.run_id = f"dc-two-nodes-{uuid.uuid4().hex[:12]}"
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.seen: Set[int] = set()  # every process of the job observed while it ran
        self._logs = [tempfile.TemporaryFile(mode="w+") for _ in range(NODES)]
        environment = launch_env(env)
        self.launchers = [
            subprocess.Popen(launcher_command(node, nproc_per_node, self.endpoint, self.run_id, script, args),
                             env=environment, cwd=ROOT, stdout=self._logs[node], stderr=subprocess.STDOUT,
                             start_new_session=True)  # its own process group, killed as one
            for node in range(NODES)
        ]

    def wait(self, timeout_s: float) -> List[str]:
        __tracebackhide__ = True
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                self._observe()
                codes = [p.poll() for p in self.launchers]
                failed = [node for node, code in enumerate(codes) if code not in (None, 0)]
                if failed:
                    self._fail(f"the launcher of node {failed[0]} exited with code {codes[failed[0]]}")
                if all(code == 0 for code in codes):
                    return self.outputs()
                if time.monotonic() > deadline:
                    self._fail(f"the job did not end within {timeout_s:.0f} s")
                time.sleep(_POLL_S)
        finally:
            self.stop()

    def outputs(self) -> List[str]:
        texts = []
        for log in self._logs:
            log.flush()
            log.seek(0)
            texts.append(log.read())
        return texts

    def _observe(self) -> None:
        for launcher in self.launchers:
            self.seen.add(launcher.pid)
            self.seen.update(descendants(launcher.pid))

    def _fail(self, why: str) -> None:
        __tracebackhide__ = True
        self.stop()
        texts = self.outputs()
        raise LaunchFailure(f"{why} (rendezvous {self.run_id} at {self.endpoint});\n"
                            + "\n".join(f"----- node {n} -----\n{t[-8000:]}" for n, t in enumerate(texts)))

    def stop(self) -> None:
        """Kill whatever of the job still runs: the launchers' groups first (no new workers are
        started after that), then every worker seen, each in its own session."""
        self._observe()
        for launcher in self.launchers:
            if launcher.poll() is None:
                try:
                    os.killpg(launcher.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for pid in self.seen:
            if pid not in {launcher.pid for launcher in self.launchers} and is_running(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for launcher in self.launchers:
            launcher.wait()

    def running(self) -> List[int]:
        """The processes of the job still running (none after :meth:`wait`)."""
        return sorted(pid for pid in self.seen if is_running(pid))
