"""Optimizer-state offload settings: what the offload keys switch on, and the memory budget.

Which keys turn optimizer-state and parameter offload on, how two switches combine (the larger
offloaded share, pinned if either asks) and when buffers are pinned are config rules
(``deepcompile/config/rules.py: offload_switches``); this module adds the budget.

The budget is ``compile.memory_budget_bytes``, else ``compile.memory_budget_fraction`` of the
GPU's memory. A CPU device has no device memory of its own to plan for: there only
``memory_budget_bytes`` is a budget; without it everything offloadable is offloaded.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from deepcompile.config.rules import offload_switches, parameter_offload_keys  # noqa: F401 (re-exported)
from deepcompile.offload import device_memory


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


def opt_state_offload_settings(config, device: torch.device) -> Optional[OptStateOffloadSettings]:
    """None when optimizer-state offload is off. What the keys switch on is decided by the config
    (``deepcompile/config/rules.py: offload_switches``); the budget is measured here."""
    switches = offload_switches(config, device.type)
    if switches is None:
        return None
    cc = config.compile
    if cc.memory_budget_bytes is not None:
        budget, name = cc.memory_budget_bytes, "compile.memory_budget_bytes"
    elif device.type == "cuda":
        budget = int(device_memory.total(device) * cc.memory_budget_fraction)
        name = f"compile.memory_budget_fraction {cc.memory_budget_fraction} of the device's memory"
    else:
        budget, name = None, "none (CPU device without compile.memory_budget_bytes)"
    return OptStateOffloadSettings(switches.enabled_by, switches.min_fraction, switches.pin_memory, budget, name,
                                   offload_masters=switches.offload_masters, force_masters=switches.force_masters,
                                   offload_state=switches.offload_state)
