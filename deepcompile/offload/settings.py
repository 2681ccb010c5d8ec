"""Optimizer-state offload settings: what the offload keys switch on, and the memory budget.

Which keys turn optimizer-state and parameter offload on, how two switches combine (the larger
offloaded share, pinned if either asks) and when buffers are pinned are config rules
(``deepcompile/config/rules.py: offload_switches``); this module adds the budget, which the
engine computes once for every planner (``deepcompile/memory/budget.py``, which states the rule;
without a budget, on a CPU device, everything offloadable is offloaded).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from deepcompile.config.rules import offload_switches, parameter_offload_keys  # noqa: F401 (re-exported)
from deepcompile.memory.budget import MemoryBudget, local_memory_budget


@dataclasses.dataclass(frozen=True)
class OptStateOffloadSettings:
    enabled_by: str  # the config key(s) that turned it on, for reports and errors
    min_fraction: float
    pin_memory: bool
    budget_bytes: Optional[int]
    budget_name: str
    # Parameter offload: the ZeRO-3 fp32 master shards are offload units, gathered from the host
    # while there; with ``force_masters`` (zero_optimization.offload_param) every one of them goes,
    # else (compile.offload_parameters) the budget decides, after the optimizer state.
    offload_masters: bool = False
    force_masters: bool = False
    # Optimizer-state offload is on: with no budget, all offloadable state goes to the host.
    # Off (parameter offload alone): without a budget the optimizer's state stays on the device.
    offload_state: bool = True


def opt_state_offload_settings(config, device: torch.device,
                               budget: Optional[MemoryBudget] = None) -> Optional[OptStateOffloadSettings]:
    """None when optimizer-state offload is off. What the keys switch on is decided by the config
    (``deepcompile/config/rules.py: offload_switches``); ``budget`` is the engine's, agreed over
    the ranks (without one, this rank's own under the same rule: settings read alone)."""
    switches = offload_switches(config, device.type)
    if switches is None:
        return None
    if budget is None:
        budget = local_memory_budget(config.compile, device)
    return OptStateOffloadSettings(switches.enabled_by, switches.min_fraction, switches.pin_memory, budget.bytes,
                                   budget.source,
                                   offload_masters=switches.offload_masters, force_masters=switches.force_masters,
                                   offload_state=switches.offload_state)
