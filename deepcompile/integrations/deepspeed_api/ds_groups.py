"""``deepspeed.utils.groups``: the sequence-parallel group accessors transformers
(``deepspeed_sp_compute_loss``) and accelerate (``deepspeed_ulysses_dl_adapter``) call, answered
from the groups ``UlyssesSPAttentionHF.register_with_transformers`` made
(runtime/sequence_parallel/ulysses_sp.py). Unlike DeepSpeed, which answers size 1 and rank 0 when
no sequence parallelism was set up, each raises then: a caller asking for the group means to split
sequences, and a silent size 1 would train each rank on its own slice."""

from __future__ import annotations

from typing import Any

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.runtime.sequence_parallel import ulysses_sp


def _mpu() -> Any:
    mpu = ulysses_sp.registered()
    if mpu is None:
        raise RuntimeError("deepspeed.utils.groups: no sequence parallelism was set up in this process; "
                           "UlyssesSPAttentionHF.register_with_transformers (which accelerate calls for "
                           "ParallelismConfig(sp_backend=\"deepspeed\", sp_size > 1)) makes the groups")
    return mpu


def _get_sequence_parallel_group() -> Any:
    return _mpu().get_sequence_parallel_group()


def _get_sequence_parallel_world_size() -> int:
    return _mpu().get_sequence_parallel_world_size()


def _get_sequence_parallel_rank() -> int:
    return _mpu().get_sequence_parallel_rank()


__getattr__ = module_getattr("deepspeed.utils.groups")
