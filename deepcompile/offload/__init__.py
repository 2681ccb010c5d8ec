"""Offloading: moving training state to host memory and back (issue 18).

Today: optimizer-state offload (``opt_states.py``: the step sequencing; ``opt_state_plan.py``: its
planning side; ``opt_state_access.py``: its state read where it is) of units (``units.py``),
planned per tensor under the memory budget (``plan.py``), copied (``unit_copies.py``) on two lanes
(``lanes.py``) into host buffers (``host_memory.py``), which are released once a unit stays on the
device (``host_release.py``).
Parameter offload rides on optimizer-state offload; activation offload has its ops and state
(``activation_ops.py``, ``activations.py``). One owner, the memory planner (``joint.py``), decides
when a plan is made and makes it (``joint_plan.py``, ``plan.py``) over every kind, each behind one
protocol (``sides.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from deepcompile.memory.budget import MemoryBudget
from deepcompile.offload.opt_states import OptimizerStateOffload
from deepcompile.offload.settings import OptStateOffloadSettings, opt_state_offload_settings


def optimizer_state_offload(config, sharding, device: torch.device, group: Optional[dist.ProcessGroup],
                            budget: Optional[MemoryBudget] = None) -> Optional[OptimizerStateOffload]:
    """The engine's optimizer-state offload, or None when the config leaves it off. ``budget``:
    the engine's memory budget (deepcompile/memory/budget.py)."""
    settings = opt_state_offload_settings(config, device, budget)
    if settings is None:
        return None
    return OptimizerStateOffload(sharding, settings, device, group, sharding.param_names())


__all__ = ["OptimizerStateOffload", "OptStateOffloadSettings", "opt_state_offload_settings",
           "optimizer_state_offload"]
