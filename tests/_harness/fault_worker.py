"""One rank of a fault test, run as its own process (``python -m _harness.fault_worker``) with
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set, as a launcher starts a training
script: the fault tests need real processes that die, raise or stop, and exit codes to read.

``train``: trains ``--steps`` steps of a tiny model under ZeRO-3 (uncompiled, gloo), with
``fault_tolerance.timeout_s`` from ``--timeout``. ``--fault KIND@STEP@RANK`` makes that rank
raise (``raise``) or freeze (``stop``: SIGSTOP, alive but silent) right before its backward of
that step, printing ``FAULT <time>`` first; a SIGKILL comes from ``DC_TEST_KILL_AT``
(faults/injection.py).

``save``: trains ``--steps`` steps, saves (the checkpoint the test then loads), writes the full
parameters and counters that it holds to ``--reference``, trains one more step and saves again
(tag ``--second-tag``, default the step's), where ``--kill-at`` (``DC_TEST_KILL_AT``'s form)
kills a rank.
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


def batch(step: int, rank: int, world_size: int):
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    n = GLOBAL_BATCH // world_size
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def build_engine(timeout_s: float):
    import deepcompile

    torch.manual_seed(0)
    model = TinyNet()
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "fault_tolerance": {"timeout_s": timeout_s}, "steps_per_print": 1000}
    return deepcompile.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2), config)


def train_step(engine, fault=None) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    loss = engine(*batch(engine.global_steps, rank, world))
    if fault is not None and fault[1] == engine.global_steps and fault[2] == rank:
        print(f"FAULT {time.time():.3f}", flush=True)
        if fault[0] == "raise":
            raise ValueError(f"injected failure on rank {rank}")
        os.kill(os.getpid(), signal.SIGSTOP)
    engine.backward(loss)
    engine.step()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("train", "save"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--fault", default=None, help="raise|stop@STEP@RANK")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--reference", default=None)
    parser.add_argument("--second-tag", default=None)
    parser.add_argument("--kill-at", default=None, help="save: armed for the second save only")
    args = parser.parse_args(argv)
    fault = None
    if args.fault:
        kind, step, rank = args.fault.split("@")
        fault = (kind, int(step), int(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    engine = build_engine(args.timeout)
    for _ in range(args.steps):
        train_step(engine, fault)
    if args.mode == "save":
        engine.save_checkpoint(args.dir, client_state={"saved_at": engine.global_steps})
        state = engine.full_state_dict()
        if dist.get_rank() == 0:
            torch.save({"params": state, "global_steps": engine.global_steps}, args.reference)
        dist.barrier()
        train_step(engine)
        from deepcompile.faults import injection

        injection.arm(args.kill_at)
        engine.save_checkpoint(args.dir, tag=args.second_tag)
    engine.destroy()
    print(f"FINISHED rank {dist.get_rank()}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
