"""Process-group setup shared by the benchmarks: NCCL with one GPU per rank, else gloo on CPU."""

from __future__ import annotations

import os
from typing import Tuple

import torch
import torch.distributed as dist


def setup() -> Tuple[torch.device, int, int]:
    """Initialise the default process group from torchrun's environment; returns (device, rank, world)."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device, dist.get_rank(), dist.get_world_size()
