"""Optimizer-state offload settings, from the config keys that turn it on.

* ``compile.offload_opt_states: true``: offload what the memory budget requires (DeepCompile's
  switch); buffers are pinned.
* ``zero_optimization.offload_optimizer: {"device": "cpu", ...}`` (DeepSpeed's switch): at least
  ``ratio`` (default 1.0: all) of the offloadable bytes, more if the budget requires;
  ``pin_memory`` (default false, as DeepSpeed) chooses pinned buffers.

Both together: the larger requirement holds, and buffers are pinned if either asks for it.

Parameter offload (ZeRO-3 only) rides on the same machinery: ``compile.offload_parameters: true``
(pinned buffers) or ``zero_optimization.offload_param: {"device": "cpu", "pin_memory": bool}``
makes every ZeRO-3 master shard (the all-gather source) an offload unit that always lives on the
host between steps; gathers read it from there (``runtime.set_host_shard``). The optimizer's state
is then offloaded only as far as the settings above say: with neither of them, only what the
budget requires.

The budget is ``compile.memory_budget_bytes``, else ``compile.memory_budget_fraction`` of the
GPU's memory. A CPU device has no device memory of its own to plan for: there only
``memory_budget_bytes`` is a budget; without it everything offloadable is offloaded.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

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


def parameter_offload_keys(config) -> str:
    """The config key(s) that turn parameter offload on ("" when off)."""
    keys = [k for k, on in (("compile.offload_parameters", config.compile.offload_parameters),
                            ("zero_optimization.offload_param", config.zero_optimization.offload_param is not None))
            if on]
    return " and ".join(keys)


def opt_state_offload_settings(config, device: torch.device) -> Optional[OptStateOffloadSettings]:
    """None when optimizer-state offload is off."""
    by_compile = config.compile.offload_opt_states
    zero = config.zero_optimization.offload_optimizer
    params_by = parameter_offload_keys(config)
    if not by_compile and zero is None and not params_by:
        return None
    enabled_by = " and ".join([k for k, on in (("compile.offload_opt_states", by_compile),
                                                ("zero_optimization.offload_optimizer", zero is not None)) if on]
                              + ([params_by] if params_by else []))
    param = config.zero_optimization.offload_param
    pin = device.type == "cuda" and (by_compile or (zero is not None and zero.pin_memory)
                                     or config.compile.offload_parameters or (param is not None and param.pin_memory))
    cc = config.compile
    if cc.memory_budget_bytes is not None:
        budget, name = cc.memory_budget_bytes, "compile.memory_budget_bytes"
    elif device.type == "cuda":
        budget = int(device_memory.total(device) * cc.memory_budget_fraction)
        name = f"compile.memory_budget_fraction {cc.memory_budget_fraction} of the device's memory"
    else:
        budget, name = None, "none (CPU device without compile.memory_budget_bytes)"
    return OptStateOffloadSettings(enabled_by, zero.ratio if zero is not None else 0.0, pin, budget, name,
                                   offload_masters=bool(params_by), force_masters=param is not None,
                                   offload_state=by_compile or zero is not None)
