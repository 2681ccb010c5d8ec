"""One parameter's fp32 values in a live engine, full or this rank's piece: its master weights, its
reduced gradient and its optimizer state, read and written through the stage's sharded-state
interface (``Sharding.shard``, ``shard_grad``, ``shard_optimizer_state``: the pieces distributed
checkpoints read and write). What the served ``deepspeed.utils.safe_get_*`` / ``safe_set_*`` are.

Each engine registers its module's parameters here (``register``), so that a parameter leads to
the engine that trains it. A full value is assembled on every rank of the stage's group with one
all-reduce of disjoint pieces (each element is one rank's value plus zeros: exact), so the full
readers are collectives: every rank of the group calls them, for the same parameter, in the same
order. The local readers and the full writers communicate nothing; the local fp32 writer is a
collective under ZeRO-1/2 (the replicated parameter is refreshed from every rank's piece).

Gradients (``full_grad``/``local_grad``): the gradient averaged over the data-parallel ranks as the
optimizer step will use it, fp32, with the fp16 loss scale divided out. It exists from the backward
that reduced it to the ``step()`` that consumes it: after the backward of an accumulation boundary,
the whole window's gradient; under ZeRO-2/3 between micro-steps, what the window's backwards have
accumulated so far (each micro-step's loss divided by gradient_accumulation_steps, as ``backward``
scales it). None when no backward of the current window reduced one (before the first backward of
a window, after ``step()``, a parameter that got no gradient, a frozen one). Refused, naming why,
where the runtime holds it where it cannot be read: ZeRO-1 between micro-steps (unreduced, inside
the runtime) and ``compile.optimizer_step_in_backward`` (consumed during the backward).
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from deepcompile.zero.sharding import GradientUnavailable, ParamShard

# id(parameter) -> (its engine, the parameter), both weak: a dropped engine is not kept alive, and
# a reused id is told apart from the parameter it was.
_owners: Dict[int, Tuple["weakref.ref", "weakref.ref"]] = {}


def register(engine: Any) -> None:
    """Make ``engine``'s module parameters lead to it (``Engine.__init__``)."""
    ref = weakref.ref(engine)
    for p in engine.module.parameters():
        _owners[id(p)] = (ref, weakref.ref(p))


def unregister(engine: Any) -> None:
    """``Engine.destroy``: its parameters lead nowhere any more."""
    for key, (ref, _) in list(_owners.items()):
        if ref() is engine or ref() is None:
            del _owners[key]


def owner(param: torch.Tensor) -> Optional[Any]:
    """The live engine whose module holds ``param``, or None."""
    entry = _owners.get(id(param))
    if entry is None or entry[1]() is not param:
        return None
    return entry[0]()


def _engine(param: Any, what: str) -> Any:
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"{what}: expected a parameter of the model, got {type(param).__name__}")
    engine = owner(param)
    if engine is None:
        raise RuntimeError(
            f"{what}: this parameter belongs to no live deepcompile engine (it must be a parameter of the model given "
            "to deepspeed.initialize / deepcompile.initialize, read while that engine lives, before destroy())")
    return engine


def _master(engine: Any, param: torch.Tensor) -> Optional[ParamShard]:
    """This rank's piece of ``param``'s fp32 master, or None when it has none (frozen, or not held
    by the optimizer: ZeRO-1/2 leave such parameters whole in the module)."""
    sharding = engine.sharding
    ds_id = sharding.ds_id_of.get(id(param))
    if ds_id is None or not sharding.has_master(ds_id):
        return None
    return sharding.shard(ds_id)


def _flat_value(value: Any, numel: int, device: torch.device, what: str) -> torch.Tensor:
    value = torch.as_tensor(value)
    if value.numel() != numel:
        raise ValueError(f"{what}: the value has {value.numel()} elements (shape {tuple(value.shape)}), the parameter "
                         f"{numel}")
    return value.detach().reshape(-1).to(device=device, dtype=torch.float32)


def _assemble(engine: Any, shard: ParamShard, piece: Optional[torch.Tensor], refusal: Optional[str],
              what: str) -> Optional[torch.Tensor]:
    """The full value from every rank's ``piece`` (lined up with ``shard``'s range; None: this rank
    has none) with one all-reduce over the stage's group, which also agrees whether any rank has a
    piece (None when none has) and whether any rank refused (then every rank raises)."""
    n = shard.numel
    buf = torch.zeros(n + 2, dtype=torch.float32, device=engine.device)
    if piece is not None:
        buf[shard.start:shard.end] = piece.reshape(-1).to(device=engine.device, dtype=torch.float32)
        buf[n] = 1
    if refusal is not None:
        buf[n + 1] = 1
    dist.all_reduce(buf, group=engine.sharding.group)
    if buf[n + 1].item():
        raise GradientUnavailable(f"{what}: {refusal or 'another rank cannot read its piece of this gradient'}")
    if not buf[n].item():
        return None
    return buf[:n].view(shard.shape)


def _refresh_module(engine: Any, param: torch.Tensor, full: torch.Tensor) -> None:
    """The masters of ``param`` were written: make the next forward compute with them. ZeRO-3
    gathers from the masters, so every gathered copy (persistent ones too) becomes stale; ZeRO-1/2
    compute with the replicated parameter, given the masters' values rounded to its dtype, as the
    step's all-gather does. ``full``: the new full fp32 value."""
    if engine.stage == 3:
        from deepcompile import runtime

        runtime.invalidate_all_gathered()
        return
    with torch.no_grad():
        param.copy_(full.view(param.shape).to(param.dtype))


def _unscaled(engine: Any, grad: torch.Tensor) -> torch.Tensor:
    grad = grad.to(torch.float32)
    scale = engine.loss_scaler.grad_scale  # fp16's loss scale (None: no scaling)
    return grad / scale if scale is not None else grad.clone()


def _grad_piece(engine: Any, shard: ParamShard) -> Tuple[Optional[torch.Tensor], Optional[str]]:
    try:
        piece = engine.sharding.shard_grad(shard.ds_id)
    except GradientUnavailable as e:
        return None, str(e)
    return (None if piece is None else _unscaled(engine, piece)), None


def _state_piece(engine: Any, shard: ParamShard, key: str, what: str) -> Optional[Any]:
    """This rank's piece of optimizer state ``key`` (a view, writable in place), a scalar state's
    value, or None before the optimizer created state for the parameter."""
    state = engine.sharding.shard_optimizer_state(shard.ds_id)
    if not state:
        return None
    if key not in state:
        raise KeyError(f"{what}: the optimizer keeps no state {key!r} for this parameter (it has: "
                       f"{', '.join(sorted(map(str, state)))})")
    return state[key]


def _per_element(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


# ---- full values (every rank calls the readers together) --------------------------------------------


def full_fp32_param(param: torch.Tensor, what: str = "full_fp32_param") -> Optional[torch.Tensor]:
    """The full fp32 master value of ``param`` (its shape), on every rank; None when it has none.
    Collective over the stage's group."""
    engine = _engine(param, what)
    shard = _master(engine, param)
    if shard is None:
        return None
    return _assemble(engine, shard, shard.local, None, what)


def full_grad(param: torch.Tensor, what: str = "full_grad") -> Optional[torch.Tensor]:
    """The full reduced fp32 gradient of ``param`` (module docstring), on every rank, or None.
    Collective over the stage's group."""
    engine = _engine(param, what)
    shard = _master(engine, param)
    if shard is None:
        return None
    piece, refusal = _grad_piece(engine, shard)
    return _assemble(engine, shard, piece, refusal, what)


def full_optimizer_state(param: torch.Tensor, key: str, what: str = "full_optimizer_state") -> Optional[Any]:
    """Optimizer state ``key`` of ``param`` (Adam's ``exp_avg``, ``exp_avg_sq``) in full, the
    parameter's shape, fp32, on every rank; a scalar state (``step``) as the optimizer keeps it;
    None before the optimizer's first step and for a parameter without master. Collective."""
    engine = _engine(param, what)
    shard = _master(engine, param)
    if shard is None:
        return None
    value = _state_piece(engine, shard, key, what)
    if value is None:
        return None
    if not _per_element(value):
        return value.detach().clone() if isinstance(value, torch.Tensor) else value
    return _assemble(engine, shard, value, None, what)


def set_full_fp32_param(param: torch.Tensor, value: Any, what: str = "set_full_fp32_param") -> None:
    """Write ``value`` (the full parameter, the same on every rank) into this rank's master piece
    and into what the next forward computes with. Every rank calls it; no communication."""
    engine = _engine(param, what)
    shard = _master(engine, param)
    if shard is None:
        raise ValueError(f"{what}: this parameter has no fp32 master (it is frozen, or the optimizer does not hold "
                         "it); write the module's parameter itself")
    flat = _flat_value(value, shard.numel, engine.device, what)
    with torch.no_grad():
        shard.local.copy_(flat[shard.start:shard.end])
    _refresh_module(engine, param, flat)


def set_full_optimizer_state(param: torch.Tensor, value: Any, key: str,
                             what: str = "set_full_optimizer_state") -> None:
    """Write ``value`` (the full state ``key``, the parameter's shape, the same on every rank) into
    this rank's piece of the optimizer state. Every rank calls it; no communication."""
    engine = _engine(param, what)
    shard = _master(engine, param)
    if shard is None:
        raise ValueError(f"{what}: this parameter has no fp32 master, hence no optimizer state")
    piece = _writable_state(engine, shard, key, what)
    flat = _flat_value(value, shard.numel, engine.device, what)
    with torch.no_grad():
        piece.copy_(flat[shard.start:shard.end])


def _writable_state(engine: Any, shard: ParamShard, key: str, what: str) -> torch.Tensor:
    piece = _state_piece(engine, shard, key, what)
    if piece is None:
        raise RuntimeError(f"{what}: the optimizer has no state for this parameter yet (torch optimizers create it "
                           "at their first step)")
    if not _per_element(piece):
        raise ValueError(f"{what}: optimizer state {key!r} is a scalar shared by the parameter group, not a "
                         "per-element value")
    return piece


# ---- this rank's piece (flat, elements [start, end) of the flattened parameter) ---------------------


def local_fp32_param(param: torch.Tensor, what: str = "local_fp32_param") -> Optional[torch.Tensor]:
    """A copy of this rank's piece of the fp32 master (possibly empty under ZeRO-1/2), or None."""
    engine = _engine(param, what)
    shard = _master(engine, param)
    return None if shard is None else shard.local.detach().clone()


def local_grad(param: torch.Tensor, what: str = "local_grad") -> Optional[torch.Tensor]:
    """This rank's piece of the reduced fp32 gradient (module docstring), lined up with
    ``local_fp32_param``, or None. Refused where ``full_grad`` is."""
    engine = _engine(param, what)
    shard = _master(engine, param)
    if shard is None:
        return None
    piece, refusal = _grad_piece(engine, shard)
    if refusal is not None:
        raise GradientUnavailable(f"{what}: {refusal}")
    return piece


def local_optimizer_state(param: torch.Tensor, key: str, what: str = "local_optimizer_state") -> Optional[Any]:
    """A copy of this rank's piece of optimizer state ``key`` (scalars as they are), or None."""
    engine = _engine(param, what)
    shard = _master(engine, param)
    if shard is None:
        return None
    value = _state_piece(engine, shard, key, what)
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def set_local_fp32_param(param: torch.Tensor, value: Any, what: str = "set_local_fp32_param") -> None:
    """Write this rank's piece of the fp32 master (``value``: as many elements as
    ``local_fp32_param`` returns). Every rank calls it with its own piece: under ZeRO-1/2 the
    replicated parameter is then rebuilt from every rank's piece (one all-reduce)."""
    engine = _engine(param, what)
    shard = _master(engine, param)
    if shard is None:
        raise ValueError(f"{what}: this parameter has no fp32 master (it is frozen, or the optimizer does not hold it)")
    flat = _flat_value(value, shard.end - shard.start, engine.device, what)
    with torch.no_grad():
        shard.local.copy_(flat)
    full = _assemble(engine, shard, shard.local, None, what) if engine.stage != 3 else None
    _refresh_module(engine, param, full)


def set_local_optimizer_state(param: torch.Tensor, value: Any, key: str,
                              what: str = "set_local_optimizer_state") -> None:
    """Write this rank's piece of optimizer state ``key``. Local."""
    engine = _engine(param, what)
    shard = _master(engine, param)
    if shard is None:
        raise ValueError(f"{what}: this parameter has no fp32 master, hence no optimizer state")
    piece = _writable_state(engine, shard, key, what)
    flat = _flat_value(value, shard.end - shard.start, engine.device, what)
    with torch.no_grad():
        piece.copy_(flat)
