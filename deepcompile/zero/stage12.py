"""ZeRO-1/2 state of an engine: replicated parameters, partitioned fp32 master weights,
optimizer state and gradients.

Each optimizer param group is one flat vector (its trainable parameters, flattened, in order),
padded to ``world * partition_numel``; rank ``r`` owns ``[r * P, (r + 1) * P)``. This rank keeps
the fp32 master weights of its partition (the optimizer is re-targeted at them, so its state is
partitioned too) and receives the averaged gradients of its partition only: the runtime reduces
each parameter's gradient to the ranks owning its pieces, never all-reducing it.

Gradient targets are step-local (seed 001): at the first backward of an accumulation window a
zeroed fp32 flat gradient partition is allocated per group and its per-parameter views are bound
as reduce targets; the runtime drops every reference to them before the optimizer step, which
uses the partition as the master weights' gradient, and the partition is freed after the step.
ZeRO-1 reduces once per window (micro-steps accumulate locally in the runtime); ZeRO-2 reduces
every micro-step into the partition.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from deepcompile import debug_checks, ops, runtime
from deepcompile.precision.loss_scaler import found_overflow
from deepcompile.precision.policy import PrecisionPolicy
from deepcompile.zero import leaf_modules
from deepcompile.zero.eager_fallback import EAGER_GRAPH_ID
from deepcompile.zero.flat_partition import GroupPartition, build_group
from deepcompile.zero.grad_clip import clip_grad_norm_
from deepcompile.zero.materialize import InitFn, materialize, still_unset
from deepcompile.zero.sharding import (GradientUnavailable, ParamShard, Sharding, fresh_optimizer_state,
                                       largest_scalar, optimizer_state_piece)


class Zero12Sharding(Sharding):
    masters_offloadable = True  # the master partitions are read by the step only

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config, precision: PrecisionPolicy,
                 group: Optional[dist.ProcessGroup], stage: int, device: Optional[torch.device] = None,
                 init_fn: Optional[InitFn] = None, init_group: Optional[dist.ProcessGroup] = None):
        # ``group``: the ranks the partitions are split over (a shard group under hybrid sharding);
        # ``init_group``: whose first rank's values every rank starts from (default ``group``).
        if optimizer.state:
            raise ValueError("deepcompile.initialize: the optimizer already has state; pass a freshly built optimizer")
        self.stage = stage
        self.precision = precision
        self.allgather_bucket_size = config.zero_optimization.allgather_bucket_size
        # Payload bytes of the post-step all-gathers since take_comm_bytes last read them.
        self._gathered_bytes = 0
        self.module = model
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._names: Dict[int, str] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            self._names.setdefault(id(p), n)
        self.ds_id_of: Dict[int, int] = {}
        self.groups: List[GroupPartition] = []
        # Identical full replicas on every rank (rank 0's values, init_fn's or unset), module by
        # module; nothing is sharded here, so the whole model is on every rank.
        self.device = device if device is not None else next(model.parameters()).device
        self.materialized = materialize(model, self.device, init_group if init_group is not None else group, init_fn,
                                        on_final=lambda p: None)
        self.unset_params = list(self.materialized.unset_params)
        for group_dict in optimizer.param_groups:
            params = [p for p in group_dict["params"] if p.requires_grad]
            for p in group_dict["params"]:
                if id(p) not in self._names:
                    raise ValueError("deepcompile.initialize: the optimizer holds a tensor that is not a parameter of the model")
            dtypes = {p.dtype for p in params}
            if len(dtypes) > 1:
                raise ValueError(f"deepcompile.initialize: a param group mixes dtypes {sorted(map(str, dtypes))}; "
                                 "ZeRO-1/2 needs one dtype per group")
            # The runtime reduces a gradient in the dtype autograd produced it in, the parameter's:
            # the only reduce dtype the policy may name for ZeRO-1/2 (register_z12_param takes none).
            wrong = [p for p in params if precision.reduce_dtype(stage, p) != p.dtype]
            if wrong:
                raise ValueError(f"deepcompile.initialize: ZeRO-{stage} can only reduce gradients in the parameters' "
                                 f"dtype, the precision policy asks {precision.reduce_dtype(stage, wrong[0])} for "
                                 f"{self._names[id(wrong[0])]} ({wrong[0].dtype})")
            ids = list(range(len(self.ds_id_of), len(self.ds_id_of) + len(params)))
            flat = build_group(params, ids, self.rank, self.world)
            for p, ds_id, off in zip(params, ids, flat.offsets):
                self.ds_id_of[id(p)] = ds_id
                # Not ``ds_id``: DeepSpeed sets that (with ``ds_status``) only on ZeRO-3's partitioned
                # parameters, and DeepSpeed-aware code reads ``ds_status`` wherever it finds ``ds_id``.
                p._dc_z12_id = ds_id
                runtime.register_z12_param(ds_id, list(p.shape), p, off, flat.partition_numel)
            self.groups.append(flat)
            group_dict["params"] = [flat.master]
        self.optimizer = optimizer
        # Eager frames (and the engine without compile()) reduce through the runtime as well.
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._reduce_eager_grad)
            for g in self.groups for p in g.params
        ]
        leaf_modules.install_scope(model, leaf_modules.replicated_scope)

    def _reduce_eager_grad(self, p: nn.Parameter) -> None:
        if p.grad is None:  # compiled graphs reduce in-graph and hand autograd None
            return
        debug_checks.note_reductions((self.ds_id_of[id(p)],))
        ops.reduce_grad(p.grad.contiguous(), EAGER_GRAPH_ID, self.ds_id_of[id(p)])
        p.grad = None

    # ---- the training loop ------------------------------------------------------------------

    def start_backward(self, boundary: bool) -> None:
        self._bind_grad_partitions(boundary)
        runtime.start_backward(boundary)

    def _bind_grad_partitions(self, boundary: bool) -> None:
        """Bind the targets at the first backward that synchronizes gradients in this window."""
        if self.stage == 1 and not boundary:
            return  # ZeRO-1 micro-steps accumulate in the runtime; nothing to bind
        for g in self.groups:
            if g.grad is not None:
                continue
            g.grad = torch.zeros_like(g.master, dtype=torch.float32)
            for piece in g.pieces():
                if piece.owned:
                    runtime.bind_grad_target(piece.ds_id, g.grad[piece.in_partition], zero=False)

    def step(self, gradient_clipping: float, grad_scale: Optional[float] = None) -> torch.Tensor:
        # The optimizer-facing partitions exist: the runtime lets go of them before the step.
        runtime.unbind_grad_targets()
        grads = [g.grad if g.grad is not None else torch.zeros_like(g.master) for g in self.groups]
        # The global norm is computed every step (gradient_clipping 0: nothing is scaled).
        norm = clip_grad_norm_(grads, gradient_clipping, self.group, self.device, grad_scale=grad_scale)
        if grad_scale is not None and found_overflow(norm):
            for g in self.groups:  # skipped on every rank: the replicated parameters stay as they are
                g.grad = None
            return norm
        # A parameter that got no gradient in this window keeps its values, as torch skips it.
        # (Its slice of the flat optimizer state still advances with a zero gradient.)
        untouched = self._unreduced_slices()
        for g, grad in zip(self.groups, grads):
            g.master.grad = grad
        self.optimizer.step()
        with torch.no_grad():
            for master, where, saved in untouched:
                master[where] = saved
        for g in self.groups:
            g.master.grad = None
            g.grad = None
        self._gather_updated_params()
        return norm

    def _unreduced_slices(self):
        saved = []
        for g in self.groups:
            for piece in g.pieces():
                if piece.owned and not runtime.was_reduced(piece.ds_id):
                    saved.append((g.master.data, piece.in_partition, g.master.data[piece.in_partition].clone()))
        return saved

    @torch.no_grad()
    def _gather_updated_params(self) -> None:
        for g in self.groups:
            if not g.params:
                continue
            dtype = self.precision.gather_dtype(g.params[0])  # one dtype per group (checked at init)
            # gloo cannot gather every half type on every torch version; fp32 is exact.
            comm_dtype = torch.float32 if self.device.type == "cpu" else dtype
            # Between steps the master partition may be in offload's host copy: each all-gather's
            # input goes to the device (one chunk at a time when the bucket is smaller).
            master = self._located(g.master.detach())
            P = g.partition_numel
            # zero_optimization.allgather_bucket_size bounds the elements of one all-gather (all
            # ranks' pieces together), hence its staging buffer.
            chunk = max(1, self.allgather_bucket_size // self.world)
            if chunk >= P:
                flat = torch.empty(P * self.world, dtype=comm_dtype, device=self.device)
                dist.all_gather_into_tensor(flat, master.to(self.device, comm_dtype), group=self.group)
                self._gathered_bytes += flat.numel() * flat.element_size()
                for p, off in zip(g.params, g.offsets):
                    p.copy_(flat[off : off + p.numel()].view_as(p))
                continue
            for lo in range(0, P, chunk):
                hi = min(P, lo + chunk)
                got = torch.empty(self.world, hi - lo, dtype=comm_dtype, device=self.device)
                dist.all_gather_into_tensor(got.view(-1), master[lo:hi].to(self.device, comm_dtype), group=self.group)
                self._gathered_bytes += got.numel() * got.element_size()
                for r in range(self.world):
                    # Rank r's piece holds flat elements [r * P + lo, r * P + hi) of the group.
                    begin, end = r * P + lo, r * P + hi
                    for p, off in zip(g.params, g.offsets):
                        a, b = max(begin, off), min(end, off + p.numel())
                        if b > a:
                            p.view(-1)[a - off : b - off].copy_(got[r, a - begin : b - begin])

    def take_comm_bytes(self) -> Dict[str, Dict[str, int]]:
        # The all-gathers of the updated partitions run on the shard group's c10d group, the same
        # ranks as the runtime's "shard" communicator; counted as it counts a gather (the output).
        gathered, self._gathered_bytes = self._gathered_bytes, 0
        return {"shard": {"all_gather": gathered}} if gathered else {}

    def eagerly_gathered_params(self) -> List[str]:
        return []  # parameters are replicated: nothing is ever gathered

    def persistent_ids(self) -> List[int]:
        return []  # nothing is gathered

    @torch.no_grad()
    def full_state_dict(self, all_ranks: bool = False) -> Dict[str, torch.Tensor]:
        # The world's rank 0 (under hybrid sharding each shard group has a first rank of its own).
        if not all_ranks and dist.get_rank() != 0:
            return {}
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def full_params(self) -> Iterator[Tuple[ParamShard, Optional[torch.Tensor]]]:
        # The module's parameters are replicated and current: nothing to gather.
        for shard in self.shards():
            yield shard, (self.module.get_parameter(shard.name).detach() if self.rank == 0 else None)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ---- sharded state ----------------------------------------------------------------------
    # Only the trainable parameters the optimizer holds are partitioned; the others stay
    # replicated in the module (and in full_state_dict) and are not listed.

    def shards(self) -> Iterator[ParamShard]:
        for g in self.groups:
            # Same storage (or offload's host copy of it); a plain tensor, writable in place.
            master = self._located(g.master.detach())
            for piece in g.pieces():
                yield self._shard_of(piece, master)

    def _shard_of(self, piece, master: torch.Tensor) -> ParamShard:
        local = master[piece.in_partition] if piece.owned else master[:0]
        r = piece.in_param
        return ParamShard(self._names[id(piece.param)], piece.ds_id, piece.param.shape, local, r.start, r.stop)

    def shard_optimizer_state(self, ds_id: int) -> Dict[str, torch.Tensor]:
        for g in self.groups:
            for piece in g.pieces():
                if piece.ds_id != ds_id:
                    continue
                where = piece.in_partition if piece.owned else slice(0, 0)
                return optimizer_state_piece(self.optimizer.state.get(g.master, {}), g.master, where, self._located)
        return {}

    def shard(self, ds_id: int) -> ParamShard:
        g, piece = self._piece_of(ds_id)
        return self._shard_of(piece, self._located(g.master.detach()))

    def _piece_of(self, ds_id: int):
        """(group, OwnedPiece) of parameter ``ds_id``; the layout is fixed at init."""
        if not hasattr(self, "_pieces"):
            self._pieces = {piece.ds_id: (g, piece) for g in self.groups for piece in g.pieces()}
        return self._pieces[ds_id]

    def shard_grad(self, ds_id: int) -> Optional[torch.Tensor]:
        g, piece = self._piece_of(ds_id)
        if g.grad is None:
            # ZeRO-1 binds the partitions at the boundary's backward only; before it, each
            # micro-step's gradient is summed unreduced in the runtime's local accumulator.
            if self.stage == 1 and runtime.holds_grad_target(ds_id):
                raise GradientUnavailable(
                    "ZeRO-1 keeps the gradients of an accumulation window's micro-steps unreduced inside deepcompile's "
                    "runtime until the backward of the window's last micro-step reduces them; read it after that "
                    "backward (and before step())")
            return None  # no backward since the last step
        if not runtime.was_reduced(ds_id):
            return None  # no gradient reached it in this window (its zeros are not a gradient)
        return g.grad[piece.in_partition] if piece.owned else g.grad[:0]

    def reset_optimizer_state(self, state: Dict[int, Dict[str, Any]]) -> None:
        # One flat master per param group, in the optimizer's group order (__init__).
        for g, group_dict in zip(self.groups, self.optimizer.param_groups):
            had = self.optimizer.state.pop(g.master, None)
            merged: Dict[str, Any] = {}
            for ds_id in g.ds_ids:
                for key, value in state.get(ds_id, {}).items():
                    if (value is None) != (merged.get(key, value) is None):
                        raise ValueError(f"optimizer state {key!r} is per-element for some parameters of a param "
                                         "group and a scalar for others")
                    merged[key] = value if value is None or key not in merged else largest_scalar(merged[key], value)
            if merged:
                self.optimizer.state[g.master] = fresh_optimizer_state(merged, g.master, group_dict)
            if had is not None or merged:
                # One param group at a time: offload takes its fresh state to the host before the
                # next group's is allocated.
                self._state_replaced(list(g.ds_ids))

    def sync_params_from_shards(self) -> None:
        self._gather_updated_params()
        self.unset_params = still_unset(self, self.unset_params, self.group, self.device)

