"""Parameters built inside the served ``deepspeed.zero.Init``: each rank keeps only its slice of
their values until ``deepspeed.initialize`` hands them to the engine.

DeepSpeed's ``zero.Init`` partitions every parameter as soon as the module that owns it is built,
and code that must see or change full values (transformers loading weights on rank 0, or
initialising them) wraps itself in ``GatheredParameters(params, modifier_rank=0)``. deepcompile
partitions at ``initialize``, with a layout it only knows there, so until then a *deferred*
parameter is held this way:

* its ``.data`` is a placeholder of the full shape that owns no memory (one element, expanded,
  whose storage refuses reads: a read or write outside a gathered block raises), with DeepSpeed's
  ``ds_shape``/``ds_numel``/``ds_status`` (NOT_AVAILABLE), which DeepSpeed-aware code reads;
* its value, once it has one, is a :class:`Preset`: this rank's contiguous ``1/world`` of the
  flattened tensor, on the CPU. The values are those of the ``modifier_rank`` (rank 0 for
  transformers), broadcast once when they are set and cut; the other ranks' are discarded, as
  DeepSpeed does.

A parameter becomes deferred when the module that owns it is attached to its parent inside
``Init`` (the module's constructor has run, so its own initialisation is kept), or at the end of
``Init`` for the root module's own parameters. Construction and the gathered blocks are
collective: every rank builds the same model and enters the same blocks, in the same order.

At ``initialize`` (:func:`hand_over`) each deferred parameter becomes a ``meta`` tensor carrying
its :class:`Preset` under ``materialize.PRESET_VALUE``; the engine's materialisation gathers it
one parameter at a time and cuts the engine's own shard, so no rank holds the full model between
build and training. Buffers are never deferred: they are computed by the modules' constructors on
every rank as without DeepSpeed (rotary ``inv_freq`` included), and buffers transformers loads
from the files are broadcast by transformers itself.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.module import register_module_module_registration_hook, register_module_parameter_registration_hook

from deepcompile import compat
from deepcompile.zero.gathered_params import ZeroParamStatus
from deepcompile.zero.materialize import PRESET_VALUE
from deepcompile.zero.partition import make_placeholder

# The attribute a deferred parameter carries before hand_over (its Preset, known or not).
DEFERRED = "_dc_deferred"
_order = itertools.count()  # one numbering on every rank: construction is the same everywhere
_HALF = (torch.bfloat16, torch.float16)


def _comm_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where a collective of ``group`` takes its tensors (NCCL: this rank's GPU)."""
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wire(t: torch.Tensor) -> torch.Tensor:
    # gloo does not carry every half type on every torch version; fp32 holds them exactly.
    return t.float() if t.device.type == "cpu" and t.dtype in _HALF else t.contiguous()


class Preset:
    """A deferred parameter's value as this rank holds it: elements ``[r*c, (r+1)*c)`` of the
    flattened tensor (``c = ceil(numel / world)``, the last slice zero-padded), or nothing yet."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, group: Optional[dist.ProcessGroup]):
        self.shape, self.dtype, self.group = torch.Size(shape), dtype, group
        self.order = next(_order)
        self.slice: Optional[torch.Tensor] = None

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def _chunk(self) -> int:
        world = dist.get_world_size(self.group)
        return -(-self.numel // world)

    def known(self) -> bool:
        return self.slice is not None

    def keep(self, full: torch.Tensor, src: int) -> None:
        """Rank ``src``'s ``full`` (the full value; any values on the other ranks) becomes the
        value: broadcast, then each rank keeps its slice. Collective."""
        wire = _wire(full.detach().to(_comm_device(self.group)))
        dist.broadcast(wire, src=dist.get_global_rank(self.group, src) if self.group is not None else src,
                       group=self.group)
        c, rank = self._chunk(), dist.get_rank(self.group)
        mine = torch.zeros(c, dtype=self.dtype)
        part = wire.reshape(-1)[rank * c:(rank + 1) * c]
        mine[:part.numel()] = part.to("cpu", self.dtype)
        self.slice = mine

    def full(self, device: torch.device) -> torch.Tensor:
        """The full value on ``device``, gathered from every rank's slice. Collective."""
        comm = _comm_device(self.group)
        mine = _wire(self.slice.to(comm))
        pieces = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(pieces, mine, group=self.group)
        return torch.cat(pieces)[:self.numel].to(device, self.dtype).reshape(self.shape)

    def held_elements(self) -> int:
        return 0 if self.slice is None else self.slice.numel()


def _placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return make_placeholder(shape, dtype, device, "a parameter built under deepspeed.zero.Init")


def preset_of(param: torch.Tensor) -> Optional[Preset]:
    return param.__dict__.get(DEFERRED)


def defer(param: nn.Parameter, group: Optional[dist.ProcessGroup], src: Optional[int] = 0) -> None:
    """Make ``param`` deferred. ``src``: the rank whose current values it keeps (collective);
    None: it has no value yet (local)."""
    preset = Preset(param.shape, param.dtype, group)
    if src is not None:
        with torch.no_grad():
            preset.keep(param.data, src)
    param.__dict__[DEFERRED] = preset
    param.data = _placeholder(param.shape, param.dtype, param.device)
    param.ds_shape, param.ds_numel, param.ds_status = preset.shape, preset.numel, ZeroParamStatus.NOT_AVAILABLE


class Building:
    """What the served ``Init`` does while a model is built: parameters registered inside it are
    deferred (keeping rank 0's values) when their module is attached to a parent, the rest at
    the end. Global torch hooks, installed only by the outermost ``Init``."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self.group = group
        self._pending: Dict[int, nn.Parameter] = {}  # registered, not yet deferred (insertion order)
        self._handles: List[Any] = []

    def start(self) -> None:
        self._handles = [register_module_parameter_registration_hook(self._on_parameter),
                         register_module_module_registration_hook(self._on_module)]

    def _on_parameter(self, module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is not None and preset_of(param) is None and not param.is_meta:
            self._pending[id(param)] = param

    def _on_module(self, parent: nn.Module, name: str, child: Optional[nn.Module]) -> None:
        if child is None:
            return
        for p in compat.direct_parameters(child).values():
            if p is not None and self._pending.pop(id(p), None) is not None:
                defer(p, self.group)

    def finish(self, failed: bool) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        pending, self._pending = list(self._pending.values()), {}
        if not failed:  # after an error the ranks may be out of step: no collectives
            for p in pending:
                defer(p, self.group)


class DeferredGather:
    """``GatheredParameters`` over deferred parameters: their full values (NaN where none yet) in
    ``.data`` for the block on every rank; on exit, ``modifier_rank``'s values (None: discarded)
    become the values and the placeholders come back. Collective."""

    def __init__(self, params: Sequence[torch.Tensor], modifier_rank: Optional[int]):
        unique = {id(p): p for p in params if preset_of(p) is not None}.values()
        self._params = sorted(unique, key=lambda p: preset_of(p).order)  # one order on every rank
        self._modifier_rank = modifier_rank
        self._entered: List[nn.Parameter] = []

    def __enter__(self) -> "DeferredGather":
        for p in self._params:
            if p.ds_status is ZeroParamStatus.AVAILABLE:
                continue  # an enclosing block holds it and restores it
            preset = preset_of(p)
            device = p.device
            with torch.no_grad():
                p.data = (preset.full(device) if preset.known() else
                          torch.full(preset.shape, float("nan") if preset.dtype.is_floating_point else 0,
                                     dtype=preset.dtype, device=device))
            p.ds_status = ZeroParamStatus.AVAILABLE
            self._entered.append(p)
        return self

    def __exit__(self, *exc: Any) -> bool:
        try:
            if self._modifier_rank is not None and exc[0] is None:
                self._keep_modifier_values()
        finally:
            for p in self._entered:
                p.data = _placeholder(p.shape, p.dtype, p.device)
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE
            self._entered = []
        return False

    def _keep_modifier_values(self) -> None:
        if not self._entered:
            return
        group = preset_of(self._entered[0]).group
        src = self._modifier_rank
        # A parameter without a value that the modifier left all NaN stays without one: it was
        # not set here (transformers gathers more than it loads or initialises).
        set_here = torch.tensor([preset_of(p).known() or not (p.is_floating_point() and bool(p.isnan().all()))
                                 for p in self._entered], dtype=torch.int32, device=_comm_device(group))
        dist.broadcast(set_here, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
        with torch.no_grad():
            for p, keep in zip(self._entered, set_here.tolist()):
                if keep:
                    preset_of(p).keep(p.data, src)


def hand_over(model: nn.Module) -> List[str]:
    """Before the engine takes ``model``: every deferred parameter becomes a ``meta`` tensor of its
    shape carrying its :class:`Preset` for the engine's materialisation, without the ``ds_*``
    attributes (the engine sets its own). Returns the names of deferred parameters that never got
    a value (the caller refuses them)."""
    unset = []
    for name, p in model.named_parameters():
        preset = p.__dict__.pop(DEFERRED, None)
        if preset is None:
            continue
        if not preset.known():
            unset.append(name)
        for key in ("ds_shape", "ds_numel", "ds_status"):
            p.__dict__.pop(key, None)
        attributes = dict(p.__dict__)
        torch.utils.swap_tensors(p, nn.Parameter(torch.empty(preset.shape, dtype=preset.dtype, device="meta"),
                                                 requires_grad=p.requires_grad))
        p.__dict__.update(attributes)
        p.__dict__[PRESET_VALUE] = preset
    return unset


def held_elements(model: nn.Module) -> Dict[str, int]:
    """How many elements of each deferred parameter this rank holds (its slice; 0 without a value)."""
    return {name: preset_of(p).held_elements() for name, p in model.named_parameters() if preset_of(p) is not None}
