"""One rank of the two-launcher job that tests/parity/test_multinode_launch.py starts through
``_harness/two_nodes.py``: torchrun runs this file as the training script on each "node".

    --mode train --model NAME --zero JSON --steps N --backend eager --out FILE
        trains a model of the parity suites (``_harness/parity_cases.py``) with deepcompile (the ``zero_optimization`` section
        given as JSON, so the sharding layout is the caller's parameter) on this rank's slice of
        every global batch; rank 0 writes the losses, gradient norms and final parameters, and
        every rank's view of the launch (its launcher's pid, node and local rank, the rendezvous
        id) and the runtime's bytes per link of the last step (where it counts them), to FILE.
    --mode fail --fail-rank R
        the launch machinery alone: rank R raises as soon as it is started, the others sleep, so
        a test can check that one failing launcher ends the whole job instead of leaving the
        other "node" waiting.

Imports of deepcompile and transformers happen only in train mode: the fail mode stays cheap.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

# Collectives give up after this long, so a rank whose peers vanished raises instead of hanging
# the launcher (the test's own deadline is longer).
COLLECTIVE_TIMEOUT_S = 120


def launch_view() -> dict:
    """What this rank was told by its launcher: enough to check that both launchers joined one
    rendezvous and that each one's ranks are consecutive (a node's ranks form a shard group)."""
    env = os.environ
    return {"rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"]), "local_rank": int(env["LOCAL_RANK"]),
            "local_world_size": int(env["LOCAL_WORLD_SIZE"]), "node_rank": int(env["GROUP_RANK"]),
            "run_id": env.get("TORCHELASTIC_RUN_ID"), "launcher_pid": os.getppid(), "pid": os.getpid()}


def train(args) -> None:
    import torch
    import torch.distributed as dist

    import deepcompile.faults

    from _harness.parity_cases import GLOBAL_BATCH, train_engine

    torch.set_num_threads(1)
    # The restart-safe group the README recommends: under torchrun it joins the store that node
    # 0's launcher serves, which is how node 1's ranks find node 0's.
    deepcompile.faults.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, launch_view())
    config = {"zero_optimization": json.loads(args.zero),
              "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dist.get_world_size()}
    result, engine = train_engine(args.model, args.steps, config, args.backend, torch.device("cpu"))
    # The runtime's bytes per link of the last step, where the runtime counts them (hybrid sharding).
    comm_bytes = getattr(engine.step_report, "comm_bytes", None)
    engine.destroy()
    if dist.get_rank() == 0:
        torch.save({"losses": result.losses, "grad_norms": result.grad_norms, "params": result.params,
                    "launch": views, "comm_bytes": comm_bytes}, args.out)
    dist.barrier()
    dist.destroy_process_group()


def fail(args) -> None:
    rank = int(os.environ["RANK"])
    # The test reads these lines to check that no rank outlives the failed job.
    print(f"multinode_worker: rank {rank} pid {os.getpid()} started", flush=True)
    if rank == args.fail_rank:
        raise SystemExit(f"multinode_worker: rank {rank} fails on purpose")
    time.sleep(600)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["train", "fail"], required=True)
    parser.add_argument("--model", default="mlp", help="a model name of _harness/parity_cases.py")
    parser.add_argument("--zero", default='{"stage": 3}', help="the zero_optimization section, as JSON")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--backend", default="eager", choices=["eager", "inductor"])
    parser.add_argument("--out", help="train mode: where rank 0 writes its results")
    parser.add_argument("--fail-rank", type=int, default=-1)
    args = parser.parse_args()
    (train if args.mode == "train" else fail)(args)


if __name__ == "__main__":
    sys.exit(main())
