"""ZeRO-3 state of an engine: partitioned parameters, sharded optimizer, eager gathering."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from deepcompile import leaf_modules, runtime
from deepcompile.eager_fallback import EagerGatherHooks, gather_full_copy
from deepcompile.zero.optimizer import ShardedOptimizer
from deepcompile.zero.partition import ShardedParam, partition_parameters


class Zero3Sharding:
    stage = 3

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config, group: Optional[dist.ProcessGroup]):
        self.module = model
        self.params: List[ShardedParam] = partition_parameters(
            model, config.zero_optimization.stage3_param_persistence_threshold, group
        )
        self.optimizer = ShardedOptimizer(optimizer, self.params, group)
        runtime.register_z3_params(
            [sp.ds_id for sp in self.params],
            [list(sp.shape) for sp in self.params],
            [sp.shard for sp in self.params],
            [None] * len(self.params),  # gradient partitions are allocated per window (optimizer.py)
            [sp.persistent for sp in self.params],
            [torch.float32 if sp.trainable else None for sp in self.params],
            gather_dtypes=[sp.gather_dtype for sp in self.params],
        )
        self.ds_id_of: Dict[int, int] = {id(sp.param): sp.ds_id for sp in self.params}
        self.eager = EagerGatherHooks(model, self.params)
        leaf_modules.install_scope(model, self.eager.leaf_scope)

    def before_backward(self, boundary: bool) -> None:
        pass

    def step(self, clip: float) -> None:
        if clip > 0:
            self.optimizer.clip_grad_norm(clip)
        self.optimizer.step()
        self.optimizer.zero_grad()
        # The master shards (the gather sources) changed in place: gathered copies (persistent
        # ones included) are stale.
        runtime.invalidate_all_gathered()

    def eagerly_gathered_params(self) -> List[str]:
        return [sp.name for sp in self.params if sp.ds_id in self.eager.gathered_ids]

    @torch.no_grad()
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        full = {id(sp.param): gather_full_copy(sp.param, sp.ds_id).cpu() for sp in self.params}
        out: Dict[str, torch.Tensor] = {}
        for name, value in self.module.state_dict(keep_vars=True).items():
            out[name] = full[id(value)] if id(value) in full else value.detach().cpu().clone()
        return out

    def close(self) -> None:
        self.eager.remove()
