"""``deepspeed.zero``: ``Init`` and ``GatheredParameters`` as transformers uses them while it
builds and loads a model under ZeRO-3.

Before ``deepspeed.initialize`` nothing is partitioned here: deepcompile partitions at
initialize (taking rank 0's values), so building the model inside ``Init`` makes a full copy on
each rank, and ``GatheredParameters`` over ordinary tensors has nothing to gather. transformers'
ZeRO-3 loading initialises and loads weights on rank 0 only (``modifier_rank=0``), which is
exactly what deepcompile then distributes. After initialize, ZeRO-3 partitioned parameters
are gathered into their ``.data`` for the block, and a ``modifier_rank``'s changes are written
back into every rank's shard (zero/gathered_params.py); ZeRO-1/2 parameters are whole already.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Optional

import torch

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.zero.gathered_params import Gathered


class Init(contextlib.ContextDecorator):
    """Accepts DeepSpeed's arguments; the model built inside is an ordinary module."""

    def __init__(self, module: Any = None, data_parallel_group: Any = None, mem_efficient_linear: bool = True,
                 remote_device: Any = None, pin_memory: bool = False, config_dict_or_path: Any = None,
                 config: Any = None, enabled: bool = True, dtype: Any = None, mpu: Any = None, **kwargs: Any):
        self.enabled = enabled

    def __enter__(self) -> "Init":
        return self

    def __exit__(self, *exc: Any) -> bool:
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
    not track that."""

    def __init__(self, params: Any, modifier_rank: Optional[int] = None, fwd_module: Any = None,
                 enabled: bool = True):
        self._gathered = Gathered(_as_list(params), modifier_rank) if enabled else None

    def __enter__(self) -> "GatheredParameters":
        if self._gathered is not None:
            self._gathered.__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self._gathered is not None:
            self._gathered.__exit__(*exc)
        return False


def register_external_parameter(module: Any, parameter: Any) -> None:
    """Parameters used outside their module are gathered by deepcompile's graph passes and eager
    hooks without being declared; nothing to do."""


__getattr__ = module_getattr("deepspeed.zero")

