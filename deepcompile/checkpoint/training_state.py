"""What checkpoints and weight files read of a training run, and what a load hands back.

The engine builds a :class:`TrainingState` (``Engine.training_state()``) and passes it in; a load
returns the :class:`StepCounters` it restored and the engine applies them. So checkpoint/
neither imports the engine nor assigns into it, and anything that holds these parts (a test, a
future trainer) can be checkpointed the same way. The live objects in it (module, sharding,
optimizer, scheduler) are restored in place through their own interfaces (``Sharding``,
``load_state_dict``), as the engine would.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn as nn

from deepcompile.zero.sharding import Sharding


@dataclasses.dataclass(frozen=True)
class StepCounters:
    """The step counters a checkpoint stores and a full load restores."""

    global_steps: int
    micro_steps: int
    skipped_steps: int = 0  # fp16: optimizer steps skipped on an overflow


@dataclasses.dataclass(frozen=True)
class TrainingState:
    module: nn.Module
    sharding: Sharding  # the ZeRO stage: shards, optimizer state, full parameters
    optimizer: Optional[torch.optim.Optimizer]  # the torch optimizer itself (param groups, class)
    lr_scheduler: Any  # None, or anything with state_dict / load_state_dict
    loss_scaler: Any  # fp16's loss scale (precision/loss_scaler.py): state_dict / load_state_dict
    group: Optional[dist.ProcessGroup]
    rank: int
    world_size: int
    device: torch.device
    gradient_accumulation_steps: int
    counters: StepCounters
    config: Dict[str, Any]  # the config as a dict, recorded beside a checkpoint for reference
    # Whether this rank writes its shards: under hybrid sharding the ranks of the first shard group
    # do, and their replicas, which hold the same pieces, write none of them.
    writes_shards: bool = True

    @property
    def stage(self) -> int:
        return self.sharding.stage


@runtime_checkable
class HoldsTrainingState(Protocol):
    """What ``load_hf_weights`` accepts besides a plain module: an engine, recognised by this."""

    def training_state(self) -> TrainingState: ...
