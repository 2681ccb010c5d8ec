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

Precision, as DeepSpeed's ``Init`` decides it (:func:`build_dtype`): ``Init(dtype=...)``; else,
with a config (``config_dict_or_path``, what transformers passes), ``torch.bfloat16`` when its
``bf16.enabled`` is true, ``torch.float16`` when ``fp16.enabled`` is, ``torch.float32`` when neither
(``"auto"`` counts as false there, as in DeepSpeed's parser); without either, ``torch.float32``
(DeepSpeed takes a half type from its accelerator there). While the model is built, the floating-
point tensors that torch's constructors return (``torch.empty``, ``zeros``, ``ones``, ``full``,
``arange``, ``eye``, ``randn``, ``tensor`` and ``torch.Tensor(...)``) are converted to that dtype
(:class:`CastOnCreation`), whatever dtype the caller asked for: parameters, buffers and
temporaries alike, as DeepSpeed does. Tensors made otherwise (``torch.rand``, ``*_like``,
arithmetic, ``.to()``) keep their dtype, and a parameter is deferred in the dtype it has, so a
module can still end with parameters of another dtype; the engine casts every floating-point
parameter to its precision policy at ``initialize`` anyway. transformers exempts ``torch.arange``
around ``Init`` (``prevent_arange_dtype_change`` swaps the wrapper factory of the served
``runtime.zero.partition_parameters``, which :class:`CastOnCreation` looks up on entry).

At ``initialize`` (:func:`hand_over`) each deferred parameter becomes a ``meta`` tensor carrying
its :class:`Preset` under ``materialize.PRESET_VALUE``; the engine's materialisation gathers it
one parameter at a time and cuts the engine's own shard, so no rank holds the full model between
build and training. Buffers are never deferred: they are computed by the modules' constructors on
every rank as without DeepSpeed (rotary ``inv_freq`` included), and buffers transformers loads
from the files are broadcast by transformers itself.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

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


# ---- precision: the dtype a model is built in ------------------------------------------------

BUILD_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what DeepSpeed's Init accepts
# How DeepSpeed's config parser (pydantic, lax) reads a boolean written as a string.
_TRUE_WORDS = {"1", "on", "t", "true", "y", "yes"}
_FALSE_WORDS = {"0", "off", "f", "false", "n", "no"}


def _flag(section: Any, dotted: str) -> bool:
    """``section["enabled"]`` as DeepSpeed reads it: absent or ``"auto"`` is false (its parser
    drops ``"auto"`` values and keeps the default); booleans, 0/1 and the usual words."""
    if section is None:
        return False
    if not isinstance(section, Mapping):
        raise ValueError(f"deepspeed.zero.Init: config section {dotted.split('.')[0]!r} must be an object, "
                         f"got {type(section).__name__}")
    value = section.get("enabled", False)
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word == "auto":
            return False
        if word in _TRUE_WORDS or word in _FALSE_WORDS:
            return word in _TRUE_WORDS
    elif isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    raise ValueError(f"deepspeed.zero.Init: config {dotted} must be true or false, got {value!r}")


def _precision_flags(config: Any) -> "tuple[bool, bool]":
    """(bf16 enabled, fp16 enabled) of a config dict, a JSON file's path, or a deepcompile Config."""
    from deepcompile.integrations.deepspeed_api.served_config import as_dict

    cfg = as_dict(config)
    if isinstance(cfg, Mapping):
        bf16 = cfg.get("bf16")
        if bf16 is None:  # DeepSpeed's older spelling, read only when "bf16" is not there
            bf16 = cfg.get("bfloat16")
        return _flag(bf16, "bf16.enabled"), _flag(cfg.get("fp16"), "fp16.enabled")
    if hasattr(cfg, "bf16") and hasattr(cfg, "fp16"):  # a parsed deepcompile.Config
        return cfg.bf16.enabled is True, cfg.fp16.enabled is True
    raise TypeError(f"deepspeed.zero.Init: config_dict_or_path must be a dict or the path of a JSON file, "
                    f"got {type(config).__name__}")


def build_dtype(config: Any = None, dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """The dtype ``Init`` builds floating-point tensors in, with DeepSpeed's precedence: ``dtype``
    when given (the config is then not read for it); else the config's ``bf16``/``fp16`` (both
    enabled is an error); else float32."""
    if dtype is None and config is not None:
        bf16, fp16 = _precision_flags(config)
        if bf16 and fp16:
            raise RuntimeError("deepspeed.zero.Init: bf16 and fp16 cannot both be enabled in the config")
        dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    elif dtype is None:
        dtype = torch.float32
    if dtype not in BUILD_DTYPES:
        raise ValueError(f"deepspeed.zero.Init(dtype={dtype!r}): DeepSpeed accepts torch.float16, "
                         "torch.bfloat16 and torch.float32")
    return dtype


# Tensor constructors whose floating-point results Init converts (DeepSpeed's list), and the
# legacy torch.Tensor(...) constructor.
CONSTRUCTORS = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")
_paused = 0  # > 0 while this module's own code runs inside Init: it makes tensors of given dtypes


@contextlib.contextmanager
def _own_tensors() -> Iterator[None]:
    """Constructors return what they are asked for (deferring, gathering: the dtypes are the
    parameters', not the build dtype)."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1


def cast_on_creation(fn: Callable, target_fp_dtype: Optional[torch.dtype] = None, target_device: Any = None,
                     **_: Any) -> Callable:
    """``fn``, a tensor constructor, returning its floating-point tensors in ``target_fp_dtype``
    (None: unchanged). The values are made as asked, then converted. ``target_device`` is
    accepted for DeepSpeed's signature and not used: deferred values wait on the CPU.

    Served as ``runtime.zero.partition_parameters.zero_wrapper_for_fp_tensor_constructor``."""
    if target_fp_dtype is None:
        return fn

    @functools.wraps(fn)
    def converted(*args: Any, **kwargs: Any) -> Any:
        made = fn(*args, **kwargs)
        if (not _paused and isinstance(made, torch.Tensor) and made.is_floating_point()
                and made.dtype != target_fp_dtype):
            made.data = made.data.to(target_fp_dtype)  # .data: a requires_grad leaf stays one
        return made

    return converted


class CastOnCreation:
    """While a model is built inside ``Init``: torch's constructors (:data:`CONSTRUCTORS` and
    ``torch.Tensor(...)``) return floating-point tensors in ``dtype``. Each is wrapped by the
    served ``partition_parameters.zero_wrapper_for_fp_tensor_constructor`` as it is on entry
    (transformers swaps in one that leaves ``torch.arange`` alone); :meth:`stop` puts back what
    was there."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._saved: Dict[str, Callable] = {}
        self._tensor_new: Optional[Any] = None  # torch.Tensor's own __new__, if it had one
        self._patched_new = False

    def start(self) -> None:
        pp = importlib.import_module("deepcompile.integrations.deepspeed_api.runtime.zero.partition_parameters")
        wrap = pp.zero_wrapper_for_fp_tensor_constructor
        for name in CONSTRUCTORS:
            original = getattr(torch, name)
            self._saved[name] = original
            setattr(torch, name, wrap(original, target_fp_dtype=self.dtype, target_device=None))
        self._tensor_new = vars(torch.Tensor).get("__new__")
        base_new = torch.Tensor.__new__
        dtype = self.dtype

        def tensor_new(cls: type, *args: Any, **kwargs: Any) -> torch.Tensor:
            made = base_new(cls, *args, **kwargs)
            # Subclasses calling up to here make their own kind of tensor: left as made.
            if cls is torch.Tensor and not _paused and made.is_floating_point() and made.dtype != dtype:
                made = made.to(dtype)
            return made

        torch.Tensor.__new__ = tensor_new
        self._patched_new = True

    def stop(self) -> None:
        for name, original in self._saved.items():
            setattr(torch, name, original)
        self._saved = {}
        if self._patched_new:
            if self._tensor_new is None:
                del torch.Tensor.__new__  # back to the inherited one
            else:
                torch.Tensor.__new__ = self._tensor_new
            self._patched_new = False


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
    None: it has no value yet (local). The parameter keeps its dtype."""
    preset = Preset(param.shape, param.dtype, group)
    with _own_tensors():
        if src is not None:
            with torch.no_grad():
                preset.keep(param.data, src)
        param.data = _placeholder(param.shape, param.dtype, param.device)
    param.__dict__[DEFERRED] = preset
    param.ds_shape, param.ds_numel, param.ds_status = preset.shape, preset.numel, ZeroParamStatus.NOT_AVAILABLE


class Building:
    """What the served ``Init`` does while a model is built: floating-point tensors from torch's
    constructors come out in ``dtype`` (:class:`CastOnCreation`); parameters registered inside it
    are deferred (keeping rank 0's values) when their module is attached to a parent, the rest at
    the end. Global torch hooks and constructors, installed only by the outermost ``Init``."""

    def __init__(self, group: Optional[dist.ProcessGroup], dtype: torch.dtype = torch.float32):
        self.group = group
        self.dtype = dtype
        self._pending: Dict[int, nn.Parameter] = {}  # registered, not yet deferred (insertion order)
        self._handles: List[Any] = []
        self._casting = CastOnCreation(dtype)

    def start(self) -> None:
        self._handles = [register_module_parameter_registration_hook(self._on_parameter),
                         register_module_module_registration_hook(self._on_module)]
        try:
            self._casting.start()
        except BaseException:
            self._casting.stop()
            for h in self._handles:
                h.remove()
            self._handles = []
            raise

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
        self._casting.stop()
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
        with _own_tensors():
            self._gather()
        return self

    def _gather(self) -> None:
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

    def __exit__(self, *exc: Any) -> bool:
        with _own_tensors():
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
        with _own_tensors():
            meta = torch.empty(preset.shape, dtype=preset.dtype, device="meta")
        torch.utils.swap_tensors(p, nn.Parameter(meta, requires_grad=p.requires_grad))
        p.__dict__.update(attributes)
        p.__dict__[PRESET_VALUE] = preset
    return unset


def held_elements(model: nn.Module) -> Dict[str, int]:
    """How many elements of each deferred parameter this rank holds (its slice; 0 without a value)."""
    return {name: preset_of(p).held_elements() for name, p in model.named_parameters() if preset_of(p) is not None}
