"""The engine's side of ``compile.free_activation`` and ``compile.offload_activation``.

Both act on compiled graphs only (the graph passes ``passes/free_activation.py`` and
``passes/offload_activation.py`` insert the ops); a forward through the engine that runs the module
uncompiled is refused while either is on, instead of silently doing nothing.

The offload plan. Until it exists, every candidate is offloaded, so a job that fits only with
offloading runs from its first step (as DeepSpeed does). At the second optimizer step it is made
from what the first two windows showed: the floor ``F``, the most device memory allocated at any
offload, reload or wait (with everything offloaded), and the bytes of each offload site. With the
memory budget ``B`` (the engine's, ``deepcompile/memory/budget.py``: ``compile.memory_budget_bytes``,
else ``memory_budget_fraction`` of the GPU; a CPU device has one only with ``memory_budget_bytes``), at most ``B - F`` bytes of
activations may stay on the device: the plan offloads the fewest bytes, largest first, that bring
the rest under that (``offload/plan.py``, the arithmetic of optimizer-state offload). Without a
budget everything stays offloaded. With optimizer-state or parameter offload on too, the plan at
that step is instead the joint one, which weighs the activations against the optimizer state and
master shards. When to plan, and the plan, are the memory planner's (``offload/joint.py``); this
module measures the floor and closes the window (``close_window``). The plan is a set of (site
key, run) pairs the ops consult at run time (a site of a graph shared by several layers runs once
per layer): no recompile.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch

from deepcompile.memory.budget import MemoryBudget, local_memory_budget
from deepcompile.offload import activation_ops, bandwidth

# On a GPU, copies under 1 MiB are dominated by launch latency and save little: not candidates.
MIN_OFFLOAD_BYTES_CUDA = 1 << 20


class ActivationMemory:
    def __init__(self, compile_config: Any, device: torch.device, budget: Optional[MemoryBudget] = None,
                 resident_elsewhere: Optional[Callable[[], int]] = None):
        """``budget``: the engine's, agreed over the ranks (without one, this rank's own under the
        same rule: a planner built alone). ``resident_elsewhere``: the bytes of the other offload
        kinds' candidates on the device now, left out of the floor (``ActivationOffloader``)."""
        self.device = device
        self.free = bool(compile_config.free_activation)
        self.free_threshold = int(compile_config.free_activation_threshold)
        self.offloader: Optional[activation_ops.ActivationOffloader] = None
        self.min_offload_bytes = MIN_OFFLOAD_BYTES_CUDA if device.type == "cuda" else 0
        if budget is None:
            budget = local_memory_budget(compile_config, device)
        self.budget, self.budget_name = budget.bytes, budget.source
        self.planned_after_step: Optional[int] = None
        self.floor_bytes: Optional[int] = None
        if compile_config.offload_activation:
            self.offloader = activation_ops.ActivationOffloader(device, compile_config.offload_activation_pin_memory,
                                                                resident_elsewhere=resident_elsewhere)
            activation_ops.activate(self.offloader)

    @property
    def offload(self) -> bool:
        return self.offloader is not None

    def check_runs_compiled(self, compiled: Any) -> None:
        if compiled is None:
            on = [k for k, v in (("compile.free_activation", self.free), ("compile.offload_activation", self.offload))
                  if v]
            raise RuntimeError(f"{' and '.join(on)} act on compiled graphs: call engine.compile() before the first "
                               "forward, or set them to false")

    def begin_micro_step(self) -> None:
        """Before each forward through the engine: closes the last micro-step's count of runs per
        offload site (``KeyStats.runs_per_micro_step``)."""
        if self.offloader is not None:
            self.offloader.end_micro_step()

    def bytes_per_s(self) -> float:
        return bandwidth.host_to_device_bytes_per_s(self.device)

    def close_window(self, global_steps: int) -> None:
        """The provisional window (every candidate offloaded) ends before optimizer step
        ``global_steps``: its floor is the plan's measurement (the memory planner decides when)."""
        self.planned_after_step = global_steps
        self.floor_bytes = self.offloader.observed_peak
        self.offloader.sample = False

    def report(self) -> Dict[str, Any]:
        o = self.offloader
        bps = self.bytes_per_s() if o is not None and o.stats else None
        tensors = o.report(bps) if o is not None else []
        stats = list(o.stats.values()) if o is not None else []
        offloaded = sum(s.nbytes * o.planned_runs(s) for s in stats)
        return {
            "free_activation": self.free,
            "free_activation_threshold_bytes": self.free_threshold,
            "offload_activation": self.offload,
            "pin_memory": o.pin_memory if o is not None else None,
            "budget": self.budget_name,
            "budget_bytes": self.budget,
            "planned_after_step": self.planned_after_step,
            "floor_bytes": self.floor_bytes,
            "h2d_bytes_per_s": bps,
            "offloaded_bytes": offloaded,
            "resident_bytes": sum(s.bytes_per_micro_step for s in stats) - offloaded,
            "predicted_transfer_ms_per_step": 2e3 * offloaded / bps if bps else 0.0,
            "tensors": tensors,
        }

    def close(self) -> None:
        if self.offloader is not None and activation_ops.active() is self.offloader:
            activation_ops.activate(None)
        self.offloader = None


def activation_memory(config: Any, device: torch.device, budget: Optional[MemoryBudget] = None,
                      resident_elsewhere: Optional[Callable[[], int]] = None) -> Optional[ActivationMemory]:
    cc = config.compile
    if not (cc.free_activation or cc.offload_activation):
        return None
    return ActivationMemory(cc, device, budget, resident_elsewhere)
