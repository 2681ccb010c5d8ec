"""One rank of a fault test, run as its own process (``python -m _harness.fault_worker``) with
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set, as a launcher starts a training
script: the fault tests need real processes that die, raise or stop, and exit codes to read.

``train``: trains ``--steps`` steps of a tiny model under ZeRO-3 (uncompiled, gloo on the CPU),
with ``fault_tolerance.timeout_s`` from ``--timeout``. ``--fault KIND@STEP@RANK`` makes that rank
raise (``raise``) or freeze (``stop``: SIGSTOP, alive but silent) right before its backward of
that step, printing ``FAULT <time>`` first; a SIGKILL comes from ``DC_TEST_KILL_AT``
(faults/injection.py).

``save``: trains ``--steps`` steps, saves (the checkpoint the test then loads), writes the full
parameters and counters that it holds to ``--reference``, trains one more step and saves again
(tag ``--second-tag``, default the step's), where ``--kill-at`` (``DC_TEST_KILL_AT``'s form)
kills a rank.

``blocked``: no process group and no model: the watchdog of rank 0 of 2 over a FileStore
(``--dir``), where rank 1's record names the process ``--peer-pid`` (the test kills it), while
this rank's main thread waits inside a native call, as over NCCL: one that releases the GIL
(``--native released``) or holds it (``held``). Prints ``WAITING`` first.

With ``DC_TEST_DEVICE=cuda`` in its environment a rank runs NCCL on GPU ``LOCAL_RANK`` instead
(model and batches there), where a survivor waits in a collective instead of raising, so only
the fault watchdog can end it; everything else is the same.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

GLOBAL_BATCH = 8


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.hidden = nn.Linear(12, 12)
        self.out = nn.Linear(12, 3)

    def forward(self, x, y):
        h = torch.tanh(self.hidden(torch.tanh(self.inp(x))))
        return ((self.out(h) - y) ** 2).mean()


def on_gpu() -> bool:
    return os.environ.get("DC_TEST_DEVICE", "").strip().lower() == "cuda"


def batch(step: int, rank: int, world_size: int, device=None):
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    n = GLOBAL_BATCH // world_size
    x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    return (x, y) if device is None else (x.to(device), y.to(device))


def build_engine(timeout_s: float, device=None):
    import deepcompile

    torch.manual_seed(0)
    model = TinyNet()
    if device is not None:
        model = model.to(device)
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "fault_tolerance": {"timeout_s": timeout_s}, "steps_per_print": 1000}
    return deepcompile.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2), config)


def train_step(engine, fault=None, device=None) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    loss = engine(*batch(engine.global_steps, rank, world, device))
    if fault is not None and fault[1] == engine.global_steps and fault[2] == rank:
        print(f"FAULT {time.time():.3f}", flush=True)
        if fault[0] == "raise":
            raise ValueError(f"injected failure on rank {rank}")
        os.kill(os.getpid(), signal.SIGSTOP)
    engine.backward(loss)
    engine.step()


def blocked_in_native_code(store_path: str, peer_pid: int, timeout_s: float, holds_gil: bool) -> None:
    """Never returns: the watchdog ends the process (or the test kills it)."""
    import ctypes

    from deepcompile.faults.status import RankStatus, machine_id
    from deepcompile.faults.watchdog import FaultWatchdog

    store = dist.FileStore(store_path, 2)
    peer = RankStatus(state="alive", phase="backward", step=2, beat=1, pid=peer_pid, machine=machine_id())
    store.set("deepcompile/faults/blocked/1", peer.encode())
    watchdog = FaultWatchdog(store, "blocked", 0, 2, timeout_s).start()
    watchdog.enter("step", 2)
    time.sleep(3 * watchdog.interval)  # the GIL is free meanwhile: the watchdog's threads are under way
    print("WAITING", flush=True)
    # ctypes.PyDLL calls keep the GIL, ctypes.CDLL calls release it (as torch's and NCCL's waits do).
    libc = ctypes.PyDLL(None) if holds_gil else ctypes.CDLL(None)
    while True:
        libc.sleep(600)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("train", "save", "blocked"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--fault", default=None, help="raise|stop@STEP@RANK")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--reference", default=None)
    parser.add_argument("--second-tag", default=None)
    parser.add_argument("--kill-at", default=None, help="save: armed for the second save only")
    parser.add_argument("--peer-pid", type=int, default=None)
    parser.add_argument("--native", choices=("held", "released"), default="released")
    args = parser.parse_args(argv)
    if args.mode == "blocked":
        blocked_in_native_code(args.dir, args.peer_pid, args.timeout, args.native == "held")
    fault = None
    if args.fault:
        kind, step, rank = args.fault.split("@")
        fault = (kind, int(step), int(rank))
    torch.set_num_threads(1)
    device = None
    if on_gpu():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device is not None else "gloo")
    engine = build_engine(args.timeout, device)
    for _ in range(args.steps):
        train_step(engine, fault, device)
    if args.mode == "save":
        engine.save_checkpoint(args.dir, client_state={"saved_at": engine.global_steps})
        state = engine.full_state_dict()
        if dist.get_rank() == 0:
            torch.save({"params": state, "global_steps": engine.global_steps}, args.reference)
        dist.barrier()
        train_step(engine, device=device)
        from deepcompile.faults import injection

        injection.arm(args.kill_at)
        engine.save_checkpoint(args.dir, tag=args.second_tag)
    engine.destroy()
    print(f"FINISHED rank {dist.get_rank()}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
