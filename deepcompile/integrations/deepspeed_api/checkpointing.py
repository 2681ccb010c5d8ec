"""``deepspeed.checkpointing``: activation checkpointing as DeepSpeed-Chat, Megatron-DeepSpeed and
Lightning's DeepSpeed strategy reach it (``configure`` once, then ``checkpoint(fn, *args)``).

``checkpoint`` is torch's non-reentrant activation checkpoint: it recomputes the forward in the
backward as DeepSpeed's does, and, unlike a reentrant one, gives gradients to the parameters used
inside even when no input requires grad, and lets deepcompile's ZeRO-3 hooks gather them again
for the recomputation. DeepSpeed's extra options (partitioning activations across model-parallel
ranks, CPU or contiguous activation buffers, profiling) are not implemented: ``configure`` accepts
them switched off (Lightning passes them all, off by default) and refuses them switched on.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional

import torch.utils.checkpoint

from deepcompile.integrations.deepspeed_api._missing import module_getattr, refused

_configured = False

# configure()'s argument -> the key of a config's "activation_checkpointing" section holding it.
_OPTIONS = {
    "partition_activations": "partition_activations",
    "contiguous_checkpointing": "contiguous_memory_optimization",
    "checkpoint_in_cpu": "cpu_checkpointing",
    "synchronize": "synchronize_checkpoint_boundary",
    "profile": "profile",
}


def _section(deepspeed_config: Any) -> Dict[str, Any]:
    if deepspeed_config is None:
        return {}
    if not isinstance(deepspeed_config, dict):
        with open(deepspeed_config) as f:
            deepspeed_config = json.load(f)
    return dict(deepspeed_config.get("activation_checkpointing") or {})


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    """Options come from ``deepspeed_config``'s (a dict or a JSON file) ``activation_checkpointing``
    section, the arguments given overriding it. ``num_checkpoints`` sizes DeepSpeed's contiguous
    buffers only, so it changes nothing here."""
    global _configured
    if mpu_ is not None:
        raise refused("deepspeed.checkpointing.configure(mpu_=...) (model-parallel activation checkpointing)",
                      "deepcompile has no model parallelism; pass mpu_=None")
    section = _section(deepspeed_config)
    given = {"partition_activations": partition_activations, "contiguous_checkpointing": contiguous_checkpointing,
             "checkpoint_in_cpu": checkpoint_in_cpu, "synchronize": synchronize, "profile": profile}
    for arg, key in _OPTIONS.items():
        value = given[arg] if given[arg] is not None else section.get(key)
        if value:
            raise refused(f"deepspeed.checkpointing.configure({arg}=True) (activation_checkpointing.{key})",
                          "switch it off; deepspeed.checkpointing.checkpoint then recomputes activations as torch's "
                          "torch.utils.checkpoint does")
    _configured = True


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """DeepSpeed frees its contiguous activation buffers here; there are none."""


def checkpoint(function: Any, *args: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


__getattr__ = module_getattr("deepspeed.checkpointing")
