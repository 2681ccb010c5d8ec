"""``deepspeed.zero``: ``Init`` and ``GatheredParameters`` as transformers uses them while it
builds and loads a model under ZeRO-3.

Inside ``Init`` parameters become *deferred* as their modules are built: each rank keeps only its
slice of their values until ``deepspeed.initialize`` (zero_init.py says how), so no rank holds a
full copy of the model between build and training. ``GatheredParameters`` over deferred
parameters gives every rank their full values for the block and keeps ``modifier_rank``'s on exit:
transformers loads the weights files on rank 0 and initialises missing weights through it. After
initialize, ZeRO-3 partitioned parameters are gathered into their ``.data`` for the block, and a
``modifier_rank``'s changes are written back into every rank's shard (zero/gathered_params.py;
a frozen ZeRO-3 engine's: frozen_shards.py); ZeRO-1/2 parameters are whole already.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Optional

import torch

from deepcompile.integrations.deepspeed_api import comm
from deepcompile.integrations.deepspeed_api._missing import missing, module_getattr
from deepcompile.integrations.deepspeed_api.frozen_shards import FrozenGather
from deepcompile.integrations.deepspeed_api.zero_init import Building, DeferredGather, build_dtype, defer, preset_of
from deepcompile.zero.gathered_params import Gathered


class Init(contextlib.ContextDecorator):
    """Parameters of the modules built inside are deferred (zero_init.py), keeping rank 0's
    values, and the floating-point tensors torch's constructors make there come out in
    ``self.dtype``: ``dtype=``, else the config's ``bf16``/``fp16`` (``config_dict_or_path``, or
    the deprecated ``config``), else float32 (zero_init.build_dtype). ``module=``: an already
    built module's parameters are deferred on entry, in the dtypes they have. ``remote_device``
    and ``pin_memory`` are accepted and change nothing (the values wait on the CPU; the engine
    places them)."""

    _building: Optional[Building] = None  # the outermost Init's; nested ones add nothing

    def __init__(self, module: Any = None, data_parallel_group: Any = None, mem_efficient_linear: bool = True,
                 remote_device: Any = None, pin_memory: bool = False, config_dict_or_path: Any = None,
                 config: Any = None, enabled: bool = True, dtype: Any = None, mpu: Any = None, **kwargs: Any):
        if mpu is not None:
            raise missing("deepspeed.zero.Init(mpu=...)")
        self.dtype = build_dtype(config if config is not None else config_dict_or_path, dtype)
        self.enabled = enabled
        self.group = data_parallel_group
        self._owns_building = False
        if enabled and module is not None:
            comm.init_distributed()
            for p in module.parameters():
                if preset_of(p) is None:
                    defer(p, self.group)

    def __enter__(self) -> "Init":
        if self.enabled and Init._building is None:
            comm.init_distributed()  # as DeepSpeed's Init: building is collective
            Init._building = Building(self.group, self.dtype)
            Init._building.start()
            self._owns_building = True
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self._owns_building:
            building, Init._building = Init._building, None
            self._owns_building = False
            building.finish(failed=exc[0] is not None)
        return False


def _as_list(params: Any) -> list:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    return [p for p in params if p is not None]


class GatheredParameters(contextlib.ContextDecorator):
    """Collective: every rank enters with the same parameters. ``fwd_module`` (DeepSpeed's
    hint to its module hooks about who uses the parameters) is ignored: deepcompile's hooks do
    not track that.

    Never traced: code that gathers inside a model's forward (TRL's fused loss gathers the LM
    head there) runs in a compiled engine too. Dynamo cannot trace the block (it swaps
    parameters' storage and runs collectives), so it leaves the function that opens it to run
    eagerly, where deepcompile's eager ZeRO hooks serve the rest of its parameters."""

    @torch.compiler.disable
    def __init__(self, params: Any, modifier_rank: Optional[int] = None, fwd_module: Any = None,
                 enabled: bool = True):
        params = _as_list(params) if enabled else []
        # Deferred (built inside Init, before initialize), partitioned by a training engine, and
        # partitioned by a frozen ZeRO-3 engine (frozen_shards.py) parameters.
        self._blocks = [DeferredGather(params, modifier_rank), Gathered(params, modifier_rank),
                        FrozenGather(params, modifier_rank)] if enabled else []
        self._entered: list = []

    @torch.compiler.disable
    def __enter__(self) -> "GatheredParameters":
        for block in self._blocks:
            block.__enter__()
            self._entered.append(block)
        return self

    @torch.compiler.disable
    def __exit__(self, *exc: Any) -> bool:
        while self._entered:
            self._entered.pop().__exit__(*exc)
        return False


def register_external_parameter(module: Any, parameter: Any) -> None:
    """Parameters used outside their module are gathered by deepcompile's graph passes and eager
    hooks without being declared; nothing to do."""


__getattr__ = module_getattr("deepspeed.zero")

