"""The default process group, made so that a torchrun restart cannot read the lost attempt's keys.

torchrun (torch 2.11/2.12) keeps one key-value store for the whole job and hands every attempt the
same one: a restarted rank that reaches ``init_process_group`` before its peers reads their
previous attempt's addresses (gloo: "connectFullMesh failed ... Connection refused"; NCCL: a
stale unique id) and the restart fails. :func:`init_process_group` puts each attempt's keys under
a prefix of its own (``TORCHELASTIC_RESTART_COUNT``), and is plain ``env://`` otherwise.

The restart count is per launcher: on several nodes it agrees as long as every node's workers
fail and restart together, which the fault watchdog makes the usual case (a node whose workers
were still healthy when another node restarted counts a membership change, not a restart).
"""

from __future__ import annotations

import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def init_process_group(backend: Optional[str] = None, timeout: Optional[datetime.timedelta] = None) -> None:
    """``torch.distributed.init_process_group`` from the launcher's environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); ``backend`` None: NCCL where CUDA is
    available, else gloo. A no-op when the group exists."""
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = timeout or DEFAULT_TIMEOUT
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Under torchrun the launcher serves the store; otherwise rank 0 does, as env:// would.
    agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_serves and rank == 0, timeout=timeout, multi_tenant=True)
    dist.init_process_group(backend, store=dist.PrefixStore(f"deepcompile/attempt{attempt}/", store), rank=rank,
                            world_size=world, timeout=timeout)
