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


def total(device: torch.device) -> int:
    """The device's memory (CUDA only)."""
    return int(torch.cuda.get_device_properties(device).total_memory)
