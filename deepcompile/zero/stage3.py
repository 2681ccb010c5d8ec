"""ZeRO-3 state of an engine: partitioned parameters, sharded optimizer, eager gathering."""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from deepcompile import compat, runtime
from deepcompile.precision.loss_scaler import found_overflow
from deepcompile.precision.policy import PrecisionPolicy
from deepcompile.zero import leaf_modules
from deepcompile.zero.backward_step import BackwardStep
from deepcompile.zero import gathered_params, placeholder_moves
from deepcompile.zero.eager_fallback import EagerGatherHooks, gather_full_copy
from deepcompile.zero.optimizer import ShardedOptimizer
from deepcompile.zero.materialize import InitFn, still_unset
from deepcompile.zero.partition import ShardedParam, partition_parameters
from deepcompile.zero.sub_groups import DEFAULT_SUB_GROUP_SIZE
from deepcompile.zero.sharding import (GradientUnavailable, ParamShard, Sharding, fresh_optimizer_state,
                                       optimizer_state_piece)


class Zero3Sharding(Sharding):
    stage = 3

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config, precision: PrecisionPolicy,
                 group: Optional[dist.ProcessGroup], device: Optional[torch.device] = None,
                 init_fn: Optional[InitFn] = None, masters_offloadable: bool = False,
                 init_group: Optional[dist.ProcessGroup] = None):
        # ``group``: the ranks parameters are partitioned over (a shard group under hybrid
        # sharding); ``init_group``: the ranks materialisation takes rank 0's values over (default
        # ``group``), the world under hybrid sharding so that every replica starts the same.
        self.module = model
        self.group = group
        self.rank = dist.get_rank(group)
        self.params: List[ShardedParam]
        self.params, self.materialized = partition_parameters(
            model, config.zero_optimization.stage3_param_persistence_threshold, group, device=device, init_fn=init_fn,
            gather_dtype=precision.gather_dtype, init_group=init_group,
        )
        self.device = self.params[0].shard.device if self.params else torch.device(device or "cpu")
        self.unset_params = list(self.materialized.unset_params)
        self.optimizer = ShardedOptimizer(optimizer, self.params, group)
        # zero_optimization.sub_group_size: the step updates at most this many master elements at
        # a time (zero/sub_groups.py); DeepSpeed's default when unset.
        self.sub_group_size = config.zero_optimization.sub_group_size or DEFAULT_SUB_GROUP_SIZE
        # The engine's policy (precision/policy.py) names the dtype trainable gradients are reduced
        # in and their partitions allocated in (communication_data_type: fp32 unless "bf16").
        runtime.register_z3_params(
            [sp.ds_id for sp in self.params],
            [list(sp.shape) for sp in self.params],
            [sp.shard for sp in self.params],
            [None] * len(self.params),  # gradient partitions are allocated per window (optimizer.py)
            [sp.persistent for sp in self.params],
            [precision.reduce_dtype(self.stage, sp.param) if sp.trainable else None for sp in self.params],
            gather_dtypes=[sp.gather_dtype for sp in self.params],
        )
        self.ds_id_of: Dict[int, int] = {id(sp.param): sp.ds_id for sp in self.params}
        # Parameter offload: the master shards (the gather sources) may live on the host between
        # steps, where the runtime gathers them from. The engine says whether it is on: which
        # offload kinds exist is not this stage's knowledge (deepcompile/offload/ plugs in through
        # ``state_access`` and ``sub_group_hooks``).
        self.masters_offloadable = masters_offloadable
        self.eager = EagerGatherHooks(model, self.params)
        leaf_modules.install_scope(model, self.eager.leaf_scope)
        gathered_params.register(self)  # deepspeed.zero.GatheredParameters finds these parameters' stage
        placeholder_moves.acquire()  # module.cpu() / .to(dtype) keep placeholders one element big
        self._moves_acquired = True
        if config.compile.optimizer_step_in_backward:
            self.backward_step = BackwardStep(self.optimizer, self.param_names(), self.sub_group_size)
            self.eager.on_leaf_reductions = self.backward_step.note_eager_reductions

    def start_backward(self, boundary: bool) -> None:
        # Gradient partitions need no preparation: the runtime allocates each at its first
        # reduction in the window.
        runtime.start_backward(boundary)

    def step(self, gradient_clipping: float, grad_scale: Optional[float] = None) -> torch.Tensor:
        # The global norm is computed every step (gradient_clipping 0: nothing is scaled).
        stepped, spent_square = [], None
        if self.backward_step is not None:  # some parameters may have stepped in the backward
            stepped, spent_square = self.backward_step.end_window(runtime.reduce_counts())
        norm = self.optimizer.clip_grad_norm(gradient_clipping, spent_square, grad_scale=grad_scale)
        if grad_scale is not None and found_overflow(norm):
            # Skipped on every rank: the masters (the gather sources) are unchanged, so gathered
            # copies stay valid.
            self.optimizer.zero_grad()
            return norm
        self.optimizer.step(self.sub_group_size, self.sub_group_hooks, already_stepped=stepped)
        self.optimizer.zero_grad()
        # The master shards (the gather sources) changed in place: gathered copies (persistent
        # ones included) are stale.
        runtime.invalidate_all_gathered()
        return norm

    def run_as_leaves(self, readers: List[torch.Tensor]) -> List[Tuple[str, nn.Module]]:
        """Every module class that directly owns a partitioned parameter sharing storage with one
        of ``readers`` runs as a leaf from now on, all its instances alike (the same code on every
        rank and in every layer)."""
        hit = {id(sp.param) for sp in self.params if any(compat.shares_storage(sp.param, t) for t in readers)}
        classes = {type(owner) for owner in self.module.modules()
                   if any(id(p) in hit for p in compat.direct_parameters(owner).values() if p is not None)}
        if not classes:
            return []
        return leaf_modules.mark_classes_after_initialize(self.module, sorted(classes, key=lambda c: c.__name__),
                                                          self.eager.leaf_scope)

    def run_graph_eagerly(self, gm, param_slots: Dict[int, int]):
        return self.eager.graph_runner(gm, param_slots)

    def eagerly_gathered_params(self) -> List[str]:
        return [sp.name for sp in self.params if sp.ds_id in self.eager.gathered_ids]

    def persistent_ids(self) -> List[int]:
        return [sp.ds_id for sp in self.params if sp.persistent]

    @torch.no_grad()
    def full_state_dict(self, all_ranks: bool = False) -> Dict[str, torch.Tensor]:
        if all_ranks:
            full = {id(sp.param): gather_full_copy(sp.param, sp.ds_id).cpu() for sp in self.params}
        else:  # gathered to the first rank only: the others never hold a full parameter
            full = {id(self.params[s.ds_id].param): t.cpu() for s, t in self.full_params() if t is not None}
            # The world's rank 0 (under hybrid sharding each shard group's first rank gathered too).
            if dist.get_rank() != 0:
                return {}
        out: Dict[str, torch.Tensor] = {}
        for name, value in self.module.state_dict(keep_vars=True).items():
            out[name] = full[id(value)] if id(value) in full else value.detach().cpu().clone()
        return out

    def close(self) -> None:
        self.eager.remove()
        gathered_params.unregister(self)
        if getattr(self, "_moves_acquired", False):
            self._moves_acquired = False
            placeholder_moves.release()
        if self.backward_step is not None:
            self.backward_step.close()

    # ---- sharded state ----------------------------------------------------------------------

    def _range(self, sp: ShardedParam):
        """This rank's elements of the flattened parameter: ``[rank * ppr, (rank + 1) * ppr)``
        less the padding past ``numel``."""
        start = min(self.rank * sp.ppr, sp.numel)
        return start, min(start + sp.ppr, sp.numel)

    def shards(self) -> Iterator[ParamShard]:
        for sp in self.params:
            yield self.shard(sp.ds_id)

    def shard(self, ds_id: int) -> ParamShard:
        sp = self.params[ds_id]
        start, end = self._range(sp)
        # `shard` is the storage of the master weights (and the gather source); a plain
        # tensor, unlike the master Parameter, so the view can be written in place. Under
        # parameter offload it may be its host copy (the runtime gathers from that one then).
        return ParamShard(sp.name, sp.ds_id, sp.shape, self._located(sp.shard)[: end - start], start, end)

    def has_master(self, ds_id: int) -> bool:
        return self.params[ds_id].master is not None

    def shard_grad(self, ds_id: int) -> Optional[torch.Tensor]:
        sp = self.params[ds_id]
        if sp.master is None:
            return None
        if self.backward_step is not None:
            raise GradientUnavailable(
                "compile.optimizer_step_in_backward is on: each layer's gradient partitions are consumed by its "
                "optimizer step during the backward, so no gradient is left to read after it; turn it off to read "
                "gradients")
        target = runtime.grad_target(ds_id)
        if target is None or not runtime.was_reduced(ds_id):
            return None  # allocated at the first reduction of the window, dropped by the step
        start, end = self._range(sp)
        return target.view(-1)[: end - start]  # the padding past numel is not the parameter's

    def param_names(self) -> Dict[int, str]:
        # Names only: no view of a shard, so an offloaded one need not come back for it.
        return {sp.ds_id: sp.name for sp in self.params}

    def shard_optimizer_state(self, ds_id: int) -> Dict[str, torch.Tensor]:
        sp = self.params[ds_id]
        if sp.master is None:
            return {}
        start, end = self._range(sp)
        return optimizer_state_piece(self.optimizer.optimizer.state.get(sp.master, {}), sp.master, slice(0, end - start),
                                     self._located)

    def reset_optimizer_state(self, state: Dict[int, Dict[str, object]]) -> None:
        opt = self.optimizer.optimizer
        group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        for sp in self.params:
            if sp.master is None:
                continue
            had = opt.state.pop(sp.master, None)
            keys = state.get(sp.ds_id)
            if keys and id(sp.master) in group_of:
                opt.state[sp.master] = fresh_optimizer_state(keys, sp.master, group_of[id(sp.master)])
            if had is not None or sp.master in opt.state:
                # One parameter at a time: offload takes each fresh state to the host before the
                # next is allocated.
                self._state_replaced([sp.ds_id])

    def sync_params_from_shards(self) -> None:
        # Shards written in place (on the device, or in the host copy the runtime gathers from
        # under parameter offload): every gathered copy is stale.
        runtime.invalidate_all_gathered()
        self.unset_params = still_unset(self, self.unset_params, self.group, self.device)

