"""Readings of device memory that the offload planner uses (bytes).

On CUDA they are the caching allocator's counters. A CPU device has no separate memory to plan
for, so both read 0 there: the plan then weighs only the offloadable tensors themselves against
``compile.memory_budget_bytes`` (tests replace these functions to plan against other readings).
"""

from __future__ import annotations

import torch


def peak_allocated(device: torch.device) -> int:
    """The most bytes allocated at once so far in this process."""
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


def allocated(device: torch.device) -> int:
    """Bytes allocated now."""
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def fits(device: torch.device, nbytes: int) -> bool:
    """Whether ``nbytes`` more can be allocated now: free device memory plus what the caching
    allocator holds unused (always on a CPU device)."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return nbytes <= free + cached
