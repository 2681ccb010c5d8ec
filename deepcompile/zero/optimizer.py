"""Sharded optimizer state: fp32 master shards, gradient partitions, clipping and the step.

The user's optimizer is kept (its class, param groups and hyper-parameters) and re-targeted at
the fp32 master shards of this rank, so its state (e.g. Adam moments) is partitioned too.

A master shard shares its storage with the shard registered in the runtime (the gather source),
so the optimizer's in-place update is all a step has to do: there is no copy back into a
parameter-dtype shard. The next gather reads the updated values and rounds them to the
parameter's dtype, exactly as a copy into a bf16 shard did.

Gradient partitions are step-local: the runtime allocates a parameter's fp32 partition at its
first reduction in an accumulation window (during the backward, as its layer finishes) and the
optimizer drops them all after the step, as ``zero_grad(set_to_none=True)`` does. A persistent
flat buffer would sit in memory through the forward and the start of the backward, where the
activations peak (docs/design/measured.md).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist

from deepcompile.zero.grad_clip import clip_grad_norm_, local_square_norm
from deepcompile.zero.partition import ShardedParam
from deepcompile.zero.sub_groups import SubGroupHooks, split_sub_groups


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
        for sp in trainable:
            if sp.shard.dtype != torch.float32:
                raise ValueError(f"ZeRO-3: the shard of trainable parameter {sp.name} must be fp32, got {sp.shard.dtype}")
            # Same storage as the registered shard: the optimizer updates the gather source itself.
            sp.master = torch.nn.Parameter(sp.shard, requires_grad=True)
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
        self.by_ds_id: Dict[int, ShardedParam] = {sp.ds_id: sp for sp in trainable}

    def grads(self) -> List[torch.Tensor]:
        """This window's gradient partitions (parameters that got no gradient have none)."""
        from deepcompile import runtime

        found = (runtime.grad_target(sp.ds_id) for sp in self.trainable)
        return [g for g in found if g is not None]

    def zero_grad(self) -> None:
        """Drop the gradient partitions; the next window allocates fresh ones."""
        from deepcompile import runtime

        runtime.unbind_grad_targets([sp.ds_id for sp in self.trainable])

    def clip_grad_norm(self, max_norm: float, spent_square: Optional[torch.Tensor] = None,
                       grad_scale: Optional[float] = None) -> torch.Tensor:
        """Clip by the global L2 norm over all ranks' partitions; returns the norm.
        ``spent_square``: squares of gradients already stepped in this window (zero/backward_step.py).
        ``grad_scale``: the fp16 loss scale to divide out (grad_clip.clip_grad_norm_)."""
        device = self.params[0].shard.device if self.params else torch.device("cpu")
        return clip_grad_norm_(self.grads(), max_norm, self.group, device, spent_square, grad_scale=grad_scale)

    def step(self, sub_group_size: Optional[int] = None, hooks: Optional[SubGroupHooks] = None,
             already_stepped: Iterable[int] = ()) -> None:
        """Update the masters from this window's gradient partitions, in sub-groups of at most
        ``sub_group_size`` elements (None: all at once); each sub-group's gradient partitions are
        dropped right after it has stepped (zero/sub_groups.py). ``already_stepped``: ds ids
        updated earlier in this window (during the backward, zero/backward_step.py)."""
        from deepcompile import runtime

        done = set(already_stepped)
        # As in torch: a parameter that got no gradient in this window is not stepped.
        stepped = [sp for sp in self.trainable if sp.ds_id not in done and runtime.was_reduced(sp.ds_id)]
        groups = self._sub_groups(stepped, sub_group_size)
        self.last_sub_groups = groups
        if not groups:
            self.optimizer.step()  # nothing to update; the optimizer still counts its step
        self._step_sub_groups(groups, hooks, unbind=len(groups) > 1)

    def step_now(self, ds_ids: Sequence[int], sub_group_size: Optional[int] = None) -> torch.Tensor:
        """Update the masters of ``ds_ids`` from their gradient partitions now (in sub-groups of
        at most ``sub_group_size`` elements) and drop those partitions. Returns this rank's sum
        of squares of the gradients, for the window's global norm."""
        from deepcompile import runtime

        members = [self.by_ds_id[i] for i in ds_ids]
        device = members[0].shard.device if members else torch.device("cpu")
        square = local_square_norm([runtime.grad_target(sp.ds_id) for sp in members], device)
        self._step_sub_groups(self._sub_groups(members, sub_group_size), None, unbind=True)
        return square

    @staticmethod
    def _sub_groups(members: List[ShardedParam], sub_group_size: Optional[int]) -> List[List[int]]:
        if sub_group_size is None:
            return [[sp.ds_id for sp in reversed(members)]] if members else []
        return split_sub_groups([(sp.ds_id, sp.shard.numel()) for sp in members], sub_group_size)

    def _step_sub_groups(self, groups: List[List[int]], hooks: Optional[SubGroupHooks], unbind: bool) -> None:
        from deepcompile import runtime

        for index, ids in enumerate(groups):
            if hooks is not None:
                hooks.before_sub_group(index, groups)
            members = [self.by_ds_id[i] for i in ids]
            for sp in members:
                grad = runtime.grad_target(sp.ds_id)
                # A partition in the reduce dtype (bf16 with communication_data_type "bf16") meets
                # the fp32 master weights in fp32.
                sp.master.grad = grad if grad.dtype == sp.master.dtype else grad.to(sp.master.dtype)
            self.optimizer.step()
            for sp in members:
                sp.master.grad = None
                # The runtime gathers from `shard`; an optimizer that rebinds `.data` instead of
                # updating in place (no torch.optim optimizer does) would silently stop training.
                if sp.master.data_ptr() != sp.shard.data_ptr():
                    raise RuntimeError(
                        f"ZeRO-3: the optimizer replaced the storage of the master weights of {sp.name} instead of "
                        "updating them in place; deepcompile gathers parameters from that storage"
                    )
            if unbind:
                # This sub-group's gradients are spent: their memory serves what comes next.
                runtime.unbind_grad_targets(ids)
            if hooks is not None:
                hooks.after_sub_group(index, groups)
