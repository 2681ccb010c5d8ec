"""The memory budget: how many bytes of device memory the plans may count on.

One rule, computed once by the engine and handed to every planner (the pass schedule's
prefetch/persistence planner, optimizer-state and parameter offload, activation offload), so they
never disagree on what fits:

* ``compile.memory_budget_bytes`` when set;
* else, on a CUDA device, ``compile.memory_budget_fraction`` of the device's capacity (the rest,
  ``1 - fraction``, is the reserve kept for the CUDA context, the communicator's buffers and
  the allocator's fragmentation, none of which the plans see);
* else (a CPU device) no budget. A CPU device's "device memory" is the host's: the offload
  readings there are 0 (``offload/device_memory.py``) and the tensors being planned never leave
  it, so a budget taken from the host's RAM would only be a number nothing is measured against.
  Without a budget the offload planners offload everything offloadable (the configured offload
  then runs), and the prefetch/persistence planner keeps to no limit.

The budget is agreed over the process group with an all-reduce MIN, so every rank plans against
the same (the tightest) number and takes the same decisions; ranks with no budget take part too,
so a rank with one and a rank without still agree (on the one that exists).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist

# Stands in for "no budget" in the MIN all-reduce: any real budget is smaller.
_NO_BUDGET = torch.iinfo(torch.int64).max


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """``bytes``: what the plans may use, None for no limit; ``source``: where the number comes
    from, in the words reports and errors show."""

    bytes: Optional[int]
    source: str

    @property
    def limited(self) -> bool:
        return self.bytes is not None


def local_memory_budget(compile_config: Any, device: torch.device) -> MemoryBudget:
    """This rank's budget under the module's rule, not agreed with the others (no collective):
    what ``memory_budget`` starts from, and what a planner built alone (a unit test) reads."""
    if compile_config.memory_budget_bytes is not None:
        return MemoryBudget(int(compile_config.memory_budget_bytes), "compile.memory_budget_bytes")
    if device.type == "cuda":
        fraction = compile_config.memory_budget_fraction
        capacity = torch.cuda.get_device_properties(device).total_memory
        return MemoryBudget(int(capacity * fraction),
                            f"compile.memory_budget_fraction {fraction} of the device's memory")
    return MemoryBudget(None, "none (CPU device without compile.memory_budget_bytes)")


def memory_budget(compile_config: Any, device: torch.device, group: Optional[dist.ProcessGroup]) -> MemoryBudget:
    """The budget every rank of ``group`` plans against: each rank's own (``local_memory_budget``),
    reduced to the smallest. Collective: every rank of the group calls it."""
    local = local_memory_budget(compile_config, device)
    t = torch.tensor([_NO_BUDGET if local.bytes is None else local.bytes], dtype=torch.int64,
                     device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    agreed = int(t.item())
    if agreed == _NO_BUDGET:
        return MemoryBudget(None, local.source)
    if agreed == local.bytes:
        return local
    return MemoryBudget(agreed, f"{local.source} (another rank's smaller budget)" if local.limited
                        else "another rank's budget")
