"""Materialising a model on the training device one module at a time (sharded initialisation).

``deepcompile.initialize`` takes a model whose parameters are on the ``meta`` device (built under
``with torch.device("meta")``, as FSDP2 users do), on the CPU, or already on the training device.
:func:`materialize` walks the modules in ``model.named_modules()`` order; for each module it
gives the parameters the module owns directly real storage on the device, runs ``init_fn(module)``
if there is one, and hands every parameter whose value is final to the stage (``on_final``): ZeRO-3
cuts this rank's shard and frees the full tensor before the next module, so a rank holds its
shards plus one module's parameters at a time; ZeRO-1/2 keep the full (replicated) parameter.

Where a parameter's value comes from:

* ``init_fn`` given: every parameter starts empty (filled with NaN) and ``init_fn(module)`` writes
  it in place. ``init_fn`` runs under a fork of the random number generators whose state is rank
  0's (the CPU generator and the device's), so every rank computes the same values without any
  broadcast: the values are those of ``for m in model.modules(): init_fn(m)`` run in one process
  on the device from rank 0's generator state. Each rank's own generator state is left as it was.
  A parameter shared by several modules (tied embeddings) stays whole until its last owner has
  run, so the result is the same as that loop's. A parameter or floating-point buffer still
  holding NaN afterwards is an error naming it (``init_fn`` must set the module's own parameters
  and buffers, in place).
* no ``init_fn``, rank 0's parameter is real (CPU or device): rank 0's values are broadcast, one
  parameter at a time, so differently seeded ranks still train one model and ranks that built the
  model on ``meta`` receive rank 0's weights.
* no ``init_fn``, a ``meta`` parameter carrying a preset value (attribute :data:`PRESET_VALUE`,
  set by the served ``deepspeed.zero.Init``: each rank holds a slice of it): the full value is
  ``preset.full(device)`` (collective, one parameter at a time).
* no ``init_fn``, rank 0's parameter is on ``meta``: its value is unknown; it is filled with NaN
  and listed in :attr:`Materialized.unset_params` until a loader writes every shard and calls
  ``Sharding.sync_params_from_shards()`` (:func:`still_unset`); the engine refuses to run a
  forward before that.

Buffers are replicated on every rank, never sharded. A real buffer moves to the device as it is
(no broadcast, as before). A buffer on ``meta`` on some rank is created again: with ``init_fn``,
which must set it (transformers' ``_init_weights`` recomputes rotary ``inv_freq``); without,
rank 0's real buffer is broadcast, and a buffer on ``meta`` on rank 0 is NaN-filled and listed in
:attr:`Materialized.unset_buffers` (the engine checks them at the first forward), or, if it is not
floating point (NaN cannot mark it), refused at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from deepcompile import compat

InitFn = Callable[[nn.Module], None]

# A meta parameter's attribute holding its value elsewhere: an object whose ``full(device)``
# returns the full tensor (collective; integrations/deepspeed_api/zero_init.py sets it).
PRESET_VALUE = "_dc_preset_value"


def training_device(model: nn.Module, device: Union[str, torch.device, None],
                    group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device the engine trains on.

    ``device`` when given; else the device of the model's parameters when they are on an
    accelerator (one device: anything else is an error); else (CPU or ``meta`` parameters) the
    CUDA device of this rank when CUDA is available and the process group runs NCCL
    (``cuda:$LOCAL_RANK``, or the current CUDA device without ``LOCAL_RANK``), otherwise the CPU.
    """
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    placed = {t.device for t in _tensors(model) if t.device.type not in ("cpu", "meta")}
    if len(placed) > 1:
        raise ValueError(f"deepcompile.initialize: the model's parameters and buffers are on several devices "
                         f"({sorted(map(str, placed))}); put them on one, or on CPU/meta and pass device=")
    if placed:
        return placed.pop()
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend(group)).lower():
        local = os.environ.get("LOCAL_RANK")
        return torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())
    return torch.device("cpu")


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


@dataclasses.dataclass
class Materialized:
    """What :func:`materialize` could not give a value to."""

    # first names of the parameters whose values are unknown (NaN) until a loader writes them
    unset_params: List[str]
    # floating-point buffers created NaN-filled: (qualified name, owning module, attribute)
    unset_buffers: List[Tuple[str, nn.Module, str]]


def _fill_unknown(t: torch.Tensor) -> torch.Tensor:
    """NaN where NaN can be represented (a use before a value is set shows up), else 0."""
    return t.fill_(float("nan")) if t.is_floating_point() or t.is_complex() else t.zero_()


def _install(param: nn.Parameter, data: torch.Tensor) -> None:
    """Give ``param`` (the same Python object: optimizers and ids built over it stay valid) the
    storage ``data``. A meta tensor cannot take another device's data through ``.data``; its
    contents are swapped instead, keeping the attributes set on the object."""
    if not param.is_meta:
        param.data = data
        return
    attributes = dict(param.__dict__)
    torch.utils.swap_tensors(param, nn.Parameter(data, requires_grad=param.requires_grad))
    param.__dict__.update(attributes)


def broadcast_from_first_rank(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Rank 0's values of ``t`` on every rank (``t`` is overwritten, or a new tensor returned)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    # gloo cannot broadcast every half type on every torch version; fp32 carries them exactly.
    staged = (t.float().contiguous() if t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16)
              else t.contiguous())
    dist.broadcast(staged, src=src, group=group)
    return staged.to(t.dtype)


@contextlib.contextmanager
def rank0_rng(device: torch.device, group: Optional[dist.ProcessGroup]):
    """Run the block with rank 0's CPU and ``device`` generator states on every rank; restore each
    rank's own states afterwards. One broadcast."""
    cuda = device.type == "cuda"
    fork = (torch.random.fork_rng(devices=[device.index], device_type="cuda") if cuda
            else torch.random.fork_rng(devices=[]))
    with fork:
        states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if cuda else [])
        sizes = [s.numel() for s in states]
        packed = broadcast_from_first_rank(torch.cat(states).to(device), group).cpu()
        cpu_state, *device_state = packed.split(sizes)
        torch.set_rng_state(cpu_state.clone())
        if cuda:
            torch.cuda.set_rng_state(device_state[0].clone(), device)
        yield


def _meta_census(model: nn.Module, group: Optional[dist.ProcessGroup], device: torch.device):
    """For every parameter and buffer (by id, in ``named_modules`` order): is it on ``meta`` on
    rank 0, and on any rank. Ranks may differ (rank 0 loads, the others build on ``meta``); one
    all-reduce makes every rank take the same decisions (and so run the same collectives)."""
    seen: Dict[int, int] = {}
    for t in _tensors(model):
        seen.setdefault(id(t), len(seen))
    flags = torch.zeros(2, len(seen), dtype=torch.int32)
    rank = dist.get_rank(group)
    for t in _tensors(model):
        if t.is_meta:
            flags[0, seen[id(t)]] = 1
            if rank == 0:
                flags[1, seen[id(t)]] = 1
    flags = flags.to(device)
    dist.all_reduce(flags, group=group)
    flags = flags.cpu()
    any_meta = {i: bool(flags[0, k]) for i, k in seen.items()}
    rank0_meta = {i: bool(flags[1, k]) for i, k in seen.items()}
    return rank0_meta, any_meta


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, group: Optional[dist.ProcessGroup],
                init_fn: Optional[InitFn], on_final: Callable[[nn.Parameter], None]) -> Materialized:
    """Give every parameter and buffer of ``model`` its storage and value on ``device``, module by
    module (the module docstring says where values come from), calling ``on_final(param)`` once
    per parameter as soon as its value is final (after its last owner's ``init_fn``).

    Collective: every rank calls it with the same model structure. Errors about the model are
    raised on every rank together.
    """
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"init_fn must be a callable taking a module, got {type(init_fn).__name__}")
    rank0_meta, any_meta = _meta_census(model, group, device)
    first_name: Dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(p), name)
    modules = list(model.named_modules())
    if init_fn is None:
        opaque = [f"{prefix + '.' if prefix else ''}{key}" for prefix, m in modules
                  for key, b in compat.direct_buffers(m).items()
                  if b is not None and rank0_meta[id(b)] and not (b.is_floating_point() or b.is_complex())]
        if opaque:
            raise ValueError(f"deepcompile.initialize: buffers {opaque} are on the meta device and are not floating "
                             "point, so whether they were set cannot be checked; pass init_fn= to initialise them")
    last_owner: Dict[int, int] = {}
    for i, (_, m) in enumerate(modules):
        for p in compat.direct_parameters(m).values():
            if p is not None:
                last_owner[id(p)] = i

    unset = Materialized([], [])
    done: Dict[int, nn.Parameter] = {}  # params given storage
    new_buffers: Dict[int, torch.Tensor] = {}  # id(old buffer) -> its replacement
    checks: List[Tuple[str, torch.Tensor]] = []  # (what, "still NaN" flag) after init_fn
    rng = rank0_rng(device, group) if init_fn is not None else contextlib.nullcontext()
    with rng:
        for i, (prefix, m) in enumerate(modules):
            params = compat.direct_parameters(m)
            own = {key: p for key, p in params.items() if p is not None and id(p) not in done}
            for p in own.values():
                done[id(p)] = p
                _install(p, _parameter_value(p, device, group, init_fn, rank0_meta[id(p)], unset, first_name))
            fresh_buffers = _materialize_buffers(m, prefix, device, group, init_fn, rank0_meta, any_meta,
                                                 new_buffers, unset)
            if init_fn is not None:
                init_fn(m)
                for key, p in own.items():
                    if params.get(key) is not p:
                        raise ValueError(f"init_fn replaced parameter {first_name[id(p)]} of {type(m).__name__} "
                                         "instead of writing it in place")
                for key in fresh_buffers:
                    b = compat.direct_buffers(m).get(key)
                    if b is not None and b.device != device:  # init_fn assigned a tensor made elsewhere
                        setattr(m, key, b.to(device))
                        b = compat.direct_buffers(m)[key]
                    if b is not None and (b.is_floating_point() or b.is_complex()):
                        checks.append((f"buffer {prefix + '.' if prefix else ''}{key}", b.isnan().any()))
            for p in {id(p): p for p in params.values() if p is not None}.values():
                if last_owner[id(p)] != i:
                    continue  # shared with a later module: whole until that one has run
                if init_fn is not None and p.is_floating_point():
                    checks.append((f"parameter {first_name[id(p)]}", p.isnan().any()))
                on_final(p)
    _raise_unset_by_init_fn(checks, device, group)
    return unset


def _parameter_value(p: nn.Parameter, device: torch.device, group, init_fn, meta_on_rank0: bool,
                     unset: Materialized, first_name: Dict[int, str]) -> torch.Tensor:
    preset = p.__dict__.pop(PRESET_VALUE, None)  # popped: _install copies the attributes over
    if init_fn is None and preset is not None:
        # In the parameter's dtype: the engine may have cast the meta parameter to the training
        # dtype (bf16/fp16) after the preset was taken in the dtype the model was built in.
        return preset.full(device).to(p.dtype)
    if init_fn is not None or meta_on_rank0:
        if init_fn is None:
            unset.unset_params.append(first_name[id(p)])
        return _fill_unknown(torch.empty(p.shape, dtype=p.dtype, device=device))
    # Rank 0's values; a rank that built this parameter on meta only receives them.
    data = torch.empty(p.shape, dtype=p.dtype, device=device) if p.is_meta else p.detach().to(device)
    return broadcast_from_first_rank(data, group)


def _materialize_buffers(m: nn.Module, prefix: str, device: torch.device, group, init_fn,
                         rank0_meta: Dict[int, bool], any_meta: Dict[int, bool],
                         new_buffers: Dict[int, torch.Tensor], unset: Materialized) -> List[str]:
    """Put ``m``'s own buffers on ``device``; returns the keys of those created empty (NaN)."""
    fresh = []
    for key, b in list(compat.direct_buffers(m).items()):
        if b is None:
            continue
        if id(b) in new_buffers:  # shared with a module already done
            setattr(m, key, new_buffers[id(b)])
            continue
        if not any_meta[id(b)]:
            value = b.to(device)  # a real buffer on every rank: kept as each rank has it
        elif init_fn is not None or rank0_meta[id(b)]:
            value = _fill_unknown(torch.empty(b.shape, dtype=b.dtype, device=device))
            fresh.append(key)
            if init_fn is None:
                unset.unset_buffers.append((f"{prefix + '.' if prefix else ''}{key}", m, key))
        else:  # real on rank 0, meta on some rank: rank 0's values
            data = torch.empty(b.shape, dtype=b.dtype, device=device) if b.is_meta else b.to(device)
            value = broadcast_from_first_rank(data, group)
        new_buffers[id(b)] = value
        setattr(m, key, value)
    return fresh


def _raise_unset_by_init_fn(checks: Sequence[Tuple[str, torch.Tensor]], device: torch.device, group) -> None:
    """Every rank raises together if ``init_fn`` left NaN in a parameter or buffer on any rank."""
    if not checks:
        return
    flags = torch.stack([flag for _, flag in checks]).to(device=device, dtype=torch.int32)
    dist.all_reduce(flags, group=group)
    bad = [what for (what, _), n in zip(checks, flags.tolist()) if n]
    if bad:
        raise ValueError(f"init_fn did not initialise {', '.join(bad)}: they still hold NaN; init_fn(module) must "
                         "set every parameter and buffer the module owns directly, in place")


def still_unset(sharding, names: Sequence[str], group: Optional[dist.ProcessGroup], device: torch.device) -> List[str]:
    """Which of the parameters ``names`` (created NaN-filled) still hold NaN on some rank: what a
    loader must write before training. Read through ``sharding.shards()``; a parameter the stage
    does not partition (ZeRO-1/2: one the optimizer does not hold) is read whole from the module.
    Collective (one all-reduce); every rank gets the same list."""
    if not names:
        return []
    order = sorted(set(names))
    pieces = {s.name: s.local for s in sharding.shards() if s.name in order}
    whole = dict(sharding.module.named_parameters(remove_duplicate=False))
    flags = torch.zeros(len(order), dtype=torch.int32, device=device)
    for k, name in enumerate(order):
        value = pieces[name] if name in pieces else whole[name].detach()
        if value.numel() and (value.is_floating_point() or value.is_complex()):
            flags[k] = value.isnan().any().to(torch.int32)
    dist.all_reduce(flags, group=group)
    return [name for name, n in zip(order, flags.tolist()) if n]
