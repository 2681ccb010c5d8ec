"""Sharded optimizer state: fp32 master shards, flat gradient partitions, clipping and the step.

The user's optimizer is kept (its class, param groups and hyper-parameters) and re-targeted at
the fp32 master shards of this rank, so its state (e.g. Adam moments) is partitioned too.

A master shard shares its storage with the shard registered in the runtime (the gather source),
so the optimizer's in-place update is all a step has to do: there is no copy back into a
parameter-dtype shard. The next gather reads the updated values and rounds them to the
parameter's dtype, exactly as a copy into a bf16 shard did.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from deepcompile.zero.partition import ShardedParam


class ShardedOptimizer:
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: List[ShardedParam],
        group: Optional[dist.ProcessGroup] = None,
    ):
        self.optimizer = optimizer
        self.params = params
        self.group = group
        by_param: Dict[int, ShardedParam] = {id(sp.param): sp for sp in params}
        trainable = [sp for sp in params if sp.trainable]
        device = params[0].shard.device if params else torch.device("cpu")
        # One flat fp32 buffer for all gradient partitions: zeroing and norms are single kernels.
        self.flat_grads = torch.zeros(sum(sp.ppr for sp in trainable), dtype=torch.float32, device=device)
        offset = 0
        for sp in trainable:
            sp.grad_partition = self.flat_grads[offset : offset + sp.ppr]
            if sp.shard.dtype != torch.float32:
                raise ValueError(f"ZeRO-3: the shard of trainable parameter {sp.name} must be fp32, got {sp.shard.dtype}")
            # Same storage as the registered shard: the optimizer updates the gather source itself.
            sp.master = torch.nn.Parameter(sp.shard, requires_grad=True)
            offset += sp.ppr
        if optimizer.state:
            raise ValueError("deepcompile.initialize: the optimizer already has state; pass a freshly built optimizer")
        for group_dict in optimizer.param_groups:
            masters = []
            for p in group_dict["params"]:
                sp = by_param.get(id(p))
                if sp is None:
                    raise ValueError(
                        "deepcompile.initialize: the optimizer holds a tensor that is not a parameter of the model"
                    )
                if sp.master is not None:
                    masters.append(sp.master)
            group_dict["params"] = masters
        self.trainable = trainable

    def zero_grad(self) -> None:
        self.flat_grads.zero_()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the global L2 norm over all ranks' partitions; returns the norm."""
        local_sq = self.flat_grads.double().pow(2).sum()
        dist.all_reduce(local_sq, group=self.group)
        norm = local_sq.sqrt().float()
        if max_norm > 0:
            coef = max_norm / (norm + 1e-6)
            if coef < 1:
                self.flat_grads.mul_(coef)
        return norm

    def step(self) -> None:
        from deepcompile import runtime

        for sp in self.trainable:
            # As in torch: a parameter that got no gradient in this window is not stepped.
            sp.master.grad = sp.grad_partition if runtime.was_reduced(sp.ds_id) else None
        self.optimizer.step()
        for sp in self.trainable:
            sp.master.grad = None
            # The runtime gathers from `shard`; an optimizer that rebinds `.data` instead of
            # updating in place (no torch.optim optimizer does) would silently stop training.
            if sp.master.data_ptr() != sp.shard.data_ptr():
                raise RuntimeError(
                    f"ZeRO-3: the optimizer replaced the storage of the master weights of {sp.name} instead of "
                    "updating them in place; deepcompile gathers parameters from that storage"
                )
