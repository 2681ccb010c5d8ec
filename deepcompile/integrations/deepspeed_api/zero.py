"""``deepspeed.zero``: ``Init`` and ``GatheredParameters`` as transformers uses them while it
builds and loads a model under ZeRO-3.

Before ``deepspeed.initialize`` nothing is partitioned here: deepcompile partitions at
initialize (taking rank 0's values), so building the model inside ``Init`` makes a full copy on
each rank, and ``GatheredParameters`` over ordinary tensors has nothing to gather. transformers'
ZeRO-3 loading initialises and loads weights on rank 0 only (``modifier_rank=0``), which is
exactly what deepcompile then distributes. Gathering parameters deepcompile has already
partitioned is not implemented: it is refused, naming the parameters.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Optional

import torch

from deepcompile.integrations.deepspeed_api._missing import missing, module_getattr


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
    def __init__(self, params: Any, modifier_rank: Optional[int] = None, fwd_module: Any = None,
                 enabled: bool = True):
        self.params = _as_list(params) if enabled else []
        partitioned = [p for p in self.params if hasattr(p, "ds_id")]
        if partitioned:
            raise missing(
                f"deepspeed.zero.GatheredParameters over {len(partitioned)} parameter(s) that deepspeed.initialize "
                "already partitioned (read full weights with engine._zero3_consolidated_16bit_state_dict(), or change "
                "the model before initialize)")

    def __enter__(self) -> "GatheredParameters":
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False


def register_external_parameter(module: Any, parameter: Any) -> None:
    """Parameters used outside their module are gathered by deepcompile's graph passes and eager
    hooks without being declared; nothing to do."""


__getattr__ = module_getattr("deepspeed.zero")

