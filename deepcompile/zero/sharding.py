"""What every ZeRO stage provides to the engine, and to whatever reads or writes sharded state.

The engine is stage-agnostic: it holds one :class:`Sharding` (``zero/stage3.py`` or
``zero/stage12.py``) and drives it through the methods below. The second group of methods
exposes this rank's part of the model as (parameter, flat range, fp32 master, optimizer state),
the shape that distributed checkpoints, loading or exporting full weights, and offloading need,
without knowing how a stage lays its partitions out.

Flat ranges are in the coordinates of the full parameter flattened in row-major order, the same
on every stage: ``ParamShard.local`` holds elements ``[start, end)`` of ``param.reshape(-1)``.
Padding is never part of a range.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch

# The piece type lives in its own leaf module so that zero/gather_full.py, which Sharding.full_params
# uses, can take it without importing this module back.
from deepcompile.zero.param_shard import ParamShard  # noqa: F401  (also named from here)
from deepcompile.zero.gather_full import gather_to_rank


class Sharding(abc.ABC):
    """One ZeRO stage's state: parameters, gradient partitions, master weights, optimizer.

    Attributes every stage sets:

    * ``stage``: 1, 2 or 3;
    * ``optimizer``: what ``engine.optimizer`` is (the stage's optimizer front);
    * ``ds_id_of``: ``id(parameter) -> ds id`` of every parameter registered with the runtime;
      the backend maps graph inputs to parameters through it;
    * ``unset_params``: names of the parameters that have no value yet (a ``meta`` model
      initialised without ``init_fn``, ``zero/materialize.py``); ``sync_params_from_shards``
      recomputes it from the shards, and the engine refuses to train while it is not empty.
    """

    stage: int
    optimizer: Any
    ds_id_of: Dict[int, int]
    # Whether the fp32 master weights are read only by the optimizer step (ZeRO-1/2: a separate
    # partition), so optimizer-state offload may keep them on the host between steps. ZeRO-3's
    # masters are the all-gather source the forward and backward read: moving them is parameter
    # offload (ZeRO-3 sets this when parameter offload is on; the runtime then gathers them from
    # their host copies).
    masters_offloadable: bool = False
    # Set by optimizer-state offload (deepcompile/offload/): where each storage's values are while
    # it may be on the host (``StateAccess``). ``shards``, ``shard_optimizer_state`` and
    # ``sync_params_from_shards`` read and write through it, so an offloaded master or moment is
    # read or written in its host copy, never brought back for that.
    state_access: Optional["StateAccess"] = None

    # Set by optimizer-state offload under ZeRO-3, which steps in sub-groups (zero/sub_groups.py):
    # called around each sub-group of the optimizer step, to stream the state through the device.
    sub_group_hooks: Optional[Any] = None
    # compile.optimizer_step_in_backward (ZeRO-3 only): zero/backward_step.py.
    backward_step: Optional[Any] = None

    def _located(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a whole master or optimizer state tensor), or the host tensor holding its values
        while offload keeps it there; views are taken of the result."""
        return t if self.state_access is None else self.state_access.locate(t)

    def _state_replaced(self, ds_ids: List[int]) -> None:
        """``reset_optimizer_state`` replaced the optimizer state of ``ds_ids``: offload adopts the
        fresh storages (moving them to the host at once where it keeps that state there)."""
        if self.state_access is not None:
            self.state_access.state_replaced(ds_ids)
    unset_params: Sequence[str] = ()

    # ---- the training loop ----------------------------------------------------------------

    @abc.abstractmethod
    def start_backward(self, boundary: bool) -> None:
        """A backward is about to run; ``boundary``: it is the last micro-step of an accumulation
        window. Makes the gradient partitions ready to receive reductions and opens the runtime's
        accumulation window for this backward."""

    @abc.abstractmethod
    def step(self, gradient_clipping: float, grad_scale: Optional[float] = None) -> torch.Tensor:
        """The optimizer step at an accumulation boundary: clip the reduced gradients to the
        global norm ``gradient_clipping`` (0: no clipping), update the master weights, drop the
        gradient partitions and make the module's parameters reflect the update. Returns the
        global L2 norm of the gradients before clipping (a 0-dim fp32 tensor on the device,
        computed every step; reading it is the caller's host synchronisation).

        ``grad_scale``: the fp16 loss scale the gradients carry (None: none). They are unscaled
        before clipping, and a non-finite global norm (an overflow on any rank: every rank sees
        the same norm) skips the update on every rank: the gradient partitions are dropped, the
        master weights and optimizer state stay as they were, and the norm returned is
        non-finite (``precision.loss_scaler.found_overflow``)."""

    @abc.abstractmethod
    def full_state_dict(self, all_ranks: bool = False) -> Dict[str, torch.Tensor]:
        """The module's state dict with full parameters, as CPU tensors, on the world's rank 0
        ({} on the others, as torch's rank-0-only full state dicts); with ``all_ranks``, identical
        on every rank. Collective: every rank must call it."""

    @abc.abstractmethod
    def eagerly_gathered_params(self) -> List[str]:
        """Names of the parameters that had to be gathered outside compiled graphs."""

    def run_as_leaves(self, readers: List[torch.Tensor]) -> List[Tuple[str, Any]]:
        """Parameters (or views of them) that eager code outside any graph is about to read:
        make the modules that own them run eagerly as leaves, with usable parameters; returns
        (name, module) of each. Stages whose parameters are always whole have nothing to do."""
        return []

    def run_graph_eagerly(self, gm: Any, param_slots: Dict[int, int]) -> Callable[..., Any]:
        """A callable running a captured (Dynamo) graph eagerly, with the parameters at
        ``param_slots`` (input index -> ds id) made usable first; for a graph that cannot be
        compiled inside a module that only just became a leaf (its current call runs on)."""
        return gm

    @abc.abstractmethod
    def persistent_ids(self) -> List[int]:
        """Ids of the parameters the runtime keeps gathered from the start (ZeRO-3's persistence
        threshold); the schedule's planners count them as resident. Empty where nothing is
        gathered."""

    @abc.abstractmethod
    def close(self) -> None:
        """Remove hooks and drop references; the engine is being destroyed."""

    # ---- sharded state, for checkpoints, weight loading/export and offload ------------------

    @abc.abstractmethod
    def shards(self) -> Iterator[ParamShard]:
        """Every partitioned parameter, once (tied parameters once), in ds id order, with this
        rank's piece of it. Every rank lists the same parameters; a rank that holds nothing of
        one gets an empty range."""

    @abc.abstractmethod
    def shard_optimizer_state(self, ds_id: int) -> Dict[str, torch.Tensor]:
        """The optimizer state of parameter ``ds_id`` on this rank, by the optimizer's key
        (``exp_avg``, ``step`` ...). Per-element state is a view lined up with
        ``ParamShard.local`` (writable in place); scalar state (Adam's ``step``) is returned as
        is, and in ZeRO-1/2 is shared by all parameters of one param group. Empty before the
        first step and for parameters the optimizer does not hold."""

    def shard(self, ds_id: int) -> ParamShard:
        """The piece ``shards()`` lists for parameter ``ds_id``."""
        return next(s for s in self.shards() if s.ds_id == ds_id)

    def has_master(self, ds_id: int) -> bool:
        """Whether ``shard(ds_id).local`` is an fp32 master the optimizer updates (ZeRO-3 also
        lists frozen parameters, whose piece is their shard in the parameter's dtype)."""
        return True

    @abc.abstractmethod
    def shard_grad(self, ds_id: int) -> Optional[torch.Tensor]:
        """This rank's piece of parameter ``ds_id``'s reduced gradient (averaged over the ranks,
        in the dtype it was reduced in, fp16's loss scale still in it), a view lined up with
        ``ParamShard.local``, as the optimizer step will read it: the current accumulation window's
        sum so far. None when the window holds none for it (no backward reduced one since the last
        step, or it got no gradient, or it is frozen). Raises :class:`GradientUnavailable` where
        the stage keeps it where it cannot be read. Local: no collective."""

    @abc.abstractmethod
    def reset_optimizer_state(self, state: Dict[int, Dict[str, Any]]) -> None:
        """Replace the optimizer's state by fresh entries to be filled in place (checkpoint
        loading). ``state`` maps the ds id of each parameter that is to have state to its keys:
        per-element state as ``None`` (allocated zero-filled, shaped like the fp32 master, so that
        ``shard_optimizer_state`` then returns writable views of it) and scalar state with its
        value (placed as torch's ``Optimizer.load_state_dict`` places it). Parameters not named
        get no state, as before their first step. ZeRO-1/2 keep one state per param group: it
        gets the union of its parameters' keys and, per scalar, the largest value given for them
        (parameters stepped a different number of times, as ZeRO-3 can leave them, continue from
        the most advanced count). Local: no collective."""

    @abc.abstractmethod
    def sync_params_from_shards(self) -> None:
        """After writing ``ParamShard.local`` tensors: make the module compute with the new
        values (ZeRO-3: gathered copies become stale; ZeRO-1/2: the replicated parameters are
        refreshed from the masters), and recompute ``unset_params`` (a loader that wrote every
        shard of a ``meta``-initialised model makes it empty). Collective: every rank must call
        it."""

    def full_params(self) -> Iterator[Tuple[ParamShard, Optional[torch.Tensor]]]:
        """Every parameter ``shards()`` lists, in full and in the parameter's dtype, one at a time:
        the tensor on the group's first rank, None on the others, which never hold more than
        their piece (zero/gather_full.py). Collective: every rank must exhaust it. Stages set
        ``module`` and ``group``; one whose parameters are replicated can skip the gathers."""
        # Pieces read from an offloaded host copy are sent from the stage's device.
        return gather_to_rank(self.shards(), lambda s: self.module.get_parameter(s.name).dtype, self.group,
                              device=getattr(self, "device", None))

    def param_names(self) -> Dict[int, str]:
        """ds id -> name of every partitioned parameter."""
        return {s.ds_id: s.name for s in self.shards()}

    def take_comm_bytes(self) -> Dict[str, Dict[str, int]]:
        """Payload bytes of the collectives the stage issued itself (through torch.distributed,
        which the runtime's counters do not see) since the last call, per link and kind, as
        ``runtime.comm_bytes`` names them; the step report adds them to the runtime's counts. Empty
        by default: a stage's training collectives go through the runtime."""
        return {}


class GradientUnavailable(RuntimeError):
    """A parameter's reduced gradient exists but cannot be read where the stage keeps it now
    (``Sharding.shard_grad``)."""


class StateAccess(Protocol):
    """What a stage reads and writes its sharded state through while part of it may live on the
    host (optimizer-state and parameter offload, offload/opt_states.py)."""

    def locate(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor holding ``t``'s values now: ``t`` itself while its storage is on the device,
        else a host tensor of the same dtype, shape, strides and offset over its host copy. No
        copy into or out of that copy is pending when it returns, so it can be read, and written
        in place (the write is what the next reload or gather sees)."""

    def state_replaced(self, ds_ids: List[int]) -> None:
        """The optimizer state of these parameters was just replaced by fresh tensors (on the
        device): take them over, offloading those whose predecessors were offloaded before the
        stage allocates the next parameter's (ZeRO-1/2: param group's), so replacing all state
        holds at most one parameter's (group's) fresh state on the device at a time."""


def optimizer_state_piece(state: Dict[str, Any], master: torch.Tensor, where: slice,
                          locate: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Dict[str, Any]:
    """One parameter's piece of the optimizer state kept for ``master`` (a 1-D master tensor):
    per-element state, shaped like ``master``, as a view ``[where]`` (of ``locate(state)``: its
    host copy while offloaded); scalars (Adam's ``step``) and non-tensors as they are."""
    def piece(value):
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == master.shape:
            return locate(value.detach())[where]
        return value

    return {key: piece(value) for key, value in state.items()}


def fresh_optimizer_state(keys: Dict[str, Any], master: torch.Tensor, group: Dict[str, Any]) -> Dict[str, Any]:
    """An optimizer state entry for ``master`` (a 1-D master tensor) with the keys of
    ``Sharding.reset_optimizer_state``: ``None`` -> zeros shaped like ``master``, a value -> that
    value, placed by torch's rule: ``step`` stays where it is (a CPU scalar) unless the group is
    ``capturable`` or ``fused`` (then fp32 on the master's device); other tensors go to the
    master's device, floating ones in its dtype."""
    out: Dict[str, Any] = {}
    for key, value in keys.items():
        if value is None:
            out[key] = torch.zeros_like(master.detach())
        elif not isinstance(value, torch.Tensor):
            out[key] = value
        elif key == "step":
            on_device = group.get("capturable", False) or group.get("fused", False)
            out[key] = value.to(dtype=torch.float32, device=master.device) if on_device else value.clone()
        elif value.is_floating_point():
            out[key] = value.to(dtype=master.dtype, device=master.device)
        else:
            out[key] = value.to(device=master.device)
    return out


def largest_scalar(a: Any, b: Any) -> Any:
    """The larger of two scalar optimizer state values (Python numbers or 0-d tensors)."""
    return b if float(b) > float(a) else a
