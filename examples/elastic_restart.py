"""Survive a killed rank: torchrun restarts the job, and the job resumes from its last checkpoint.

    torchrun --nproc-per-node 2 --max-restarts 3 examples/elastic_restart.py [--out DIR] [--steps N]
                                                                               [--save-every K] [--cpu]

The script is what a restartable training script needs and no more: at start, load ``latest``
if the checkpoint folder has one; train; save every ``--save-every`` optimizer steps. The data
position is the step counter, so a resumed run sees the batches the lost run would have seen.
When a rank dies (killed, out of memory, a node gone), deepcompile's fault watchdog makes the
others exit at once, naming it, instead of waiting in a collective (``fault_tolerance`` in the
config, docs/faults.md); torchrun sees the failed workers and, while ``--max-restarts`` allows,
starts them all again. Each start prints which attempt it is (``TORCHELASTIC_RESTART_COUNT``) and
where it resumed; rank 0 ends with a digest of the final parameters, which is bitwise the one of
a run that was never interrupted (tests/faults/test_faults.py checks it).

Try it: ``DC_TEST_KILL_AT=backward:5@1`` kills rank 1 with SIGKILL as it starts the backward of
step 5 on the first attempt (deepcompile/faults/injection.py)::

    DC_TEST_KILL_AT=backward:5@1 torchrun --nproc-per-node 2 --max-restarts 1 examples/elastic_restart.py --cpu

prints, among torchrun's own lines about the failed worker and the restart::

    elastic_restart: attempt 0, 2 ranks on cpu, starting at step 0
    elastic_restart: saved checkpoint /tmp/deepcompile-elastic/checkpoints/global_step2
    elastic_restart: saved checkpoint /tmp/deepcompile-elastic/checkpoints/global_step4
    deepcompile test hook: DC_TEST_KILL_AT=backward:5@1: killing this process (pid ...) at backward:5
    deepcompile: rank 1 died during backward of step 5: its process (pid ...) is gone without a Python
    error (killed, or crashed in native code). Rank 0 (in backward of step 5) exits with code 75 ...
    elastic_restart: attempt 1, 2 ranks on cpu, resumed from .../checkpoints/global_step4 at step 4
    elastic_restart: saved checkpoint /tmp/deepcompile-elastic/checkpoints/global_step6
    elastic_restart: saved checkpoint /tmp/deepcompile-elastic/checkpoints/global_step8
    elastic_restart: trained to step 8; parameter digest 3f9a...

Run the command again and it finds step 8 done: nothing to train, the same digest. Delete
``--out`` to start over.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

import deepcompile
import deepcompile.faults

GLOBAL_BATCH = 16


class Net(nn.Module):
    """A small model with dropout: the resumed run must restore the random generators as well."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.GELU(),
                                    nn.Linear(64, 4))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.layers(x), y)


def batch_of_step(step: int, rank: int, world: int, device: torch.device):
    """This rank's slice of the global batch of optimizer step ``step``: the data position is the
    step counter, which the checkpoint restores. Replace with your data loader, and keep its
    position in ``client_state`` (examples/finetune.py does)."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    n = GLOBAL_BATCH // world
    return x[rank * n:(rank + 1) * n].to(device), y[rank * n:(rank + 1) * n].to(device)


def training_device(force_cpu: bool) -> torch.device:
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if force_cpu or not torch.cuda.is_available() or torch.cuda.device_count() < local_world:
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def digest(state: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].float().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "deepcompile-elastic"))
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps in all")
    parser.add_argument("--save-every", type=int, default=2, help="checkpoint every this many optimizer steps")
    parser.add_argument("--timeout", type=float, default=60.0, help="fault_tolerance.timeout_s: seconds of silence "
                        "after which the other ranks give up on a rank")
    parser.add_argument("--final", default=None, help="also write the final full parameters here (torch.save)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU with gloo even where there are GPUs")
    args = parser.parse_args()

    device = training_device(args.cpu)
    # As dist.init_process_group, with each torchrun attempt's keys apart: torch's own env://
    # would let a restarted rank read the lost attempt's addresses (deepcompile/faults/restartable.py).
    deepcompile.faults.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))

    torch.manual_seed(0)  # the same initial weights on every attempt; a resume overwrites them anyway
    model = Net()
    config = {"zero_optimization": {"stage": 3}, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "fault_tolerance": {"timeout_s": args.timeout}}
    engine = deepcompile.initialize(model, None, config, device=device)

    checkpoints = os.path.join(args.out, "checkpoints")
    where = "starting at step 0"
    if os.path.exists(os.path.join(checkpoints, "latest")):
        # Weights, optimizer state, step counters and every rank's random generators.
        path, _ = engine.load_checkpoint(checkpoints)
        where = f"resumed from {path} at step {engine.global_steps}"
    if rank == 0:
        print(f"elastic_restart: attempt {attempt}, {world} ranks on {device.type}, {where}", flush=True)

    if engine.global_steps == 0:
        torch.manual_seed(1 + rank)  # dropout: each rank its own stream (a resume restored the generators)
    while engine.global_steps < args.steps:
        loss = engine(*batch_of_step(engine.global_steps, rank, world, device))
        engine.backward(loss)
        engine.step()
        if engine.global_steps % args.save_every == 0 or engine.global_steps == args.steps:
            path = engine.save_checkpoint(checkpoints)
            if rank == 0:
                print(f"elastic_restart: saved checkpoint {path}", flush=True)

    state = engine.full_state_dict()  # rank 0 gets every parameter in full
    if rank == 0:
        print(f"elastic_restart: trained to step {engine.global_steps}; parameter digest {digest(state)}", flush=True)
        if args.final:
            torch.save(state, args.final)
    engine.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
