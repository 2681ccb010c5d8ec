"""One decision for every rank: the largest of each value over the process group.

Every offload decision that a rank could take differently from another (a re-plan, a budget
that cannot be met, a host buffer that could not be allocated) is agreed with this first, so
the ranks run the same collectives and raise alike."""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist


def max_over_ranks(values: List[float], device: torch.device, group: Optional[dist.ProcessGroup]) -> List[int]:
    """The largest of each value over the ranks of ``group``, as integers (collective)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]
