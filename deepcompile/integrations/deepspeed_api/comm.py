"""``deepspeed.comm``: process-group setup and the few collectives callers reach through it.

DeepSpeed's comm wraps torch.distributed; here the names go straight to it. ``init_distributed``
picks gloo where there is no GPU, which is what lets accelerate's DeepSpeed path run on CPU.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from deepcompile.integrations.deepspeed_api._missing import module_getattr

ReduceOp = dist.ReduceOp
is_initialized = dist.is_initialized
get_rank = dist.get_rank
get_world_size = dist.get_world_size
barrier = dist.barrier
all_reduce = dist.all_reduce
broadcast = dist.broadcast
all_gather = dist.all_gather
# The rest of what training scripts call (DeepSpeed-Chat, OpenRLHF, open-instruct): the same
# signatures as torch.distributed's, which DeepSpeed's wrappers forward to.
all_gather_into_tensor = dist.all_gather_into_tensor
reduce_scatter_tensor = dist.reduce_scatter_tensor
all_to_all_single = dist.all_to_all_single
broadcast_object_list = dist.broadcast_object_list
send = dist.send
recv = dist.recv
isend = dist.isend
irecv = dist.irecv
new_group = dist.new_group
get_global_rank = dist.get_global_rank
destroy_process_group = dist.destroy_process_group


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: Any = None, verbose: bool = True,
                     timeout: Optional[datetime.timedelta] = None, init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config: Any = None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Initialise the default process group from the launcher's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT: torchrun and ``accelerate launch`` set them); a no-op when it is
    already initialised. MPI discovery is not implemented (launch with torchrun)."""
    if dist.is_initialized():
        return
    kwargs: dict = {"backend": dist_backend or default_backend(), "init_method": init_method or "env://"}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if rank >= 0 and world_size > 0:
        kwargs.update(rank=rank, world_size=world_size)
    if kwargs["backend"] == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(get_local_rank())
    dist.init_process_group(**kwargs)


__getattr__ = module_getattr("deepspeed.comm")
