"""``deepspeed.utils``: the logger transformers sets the level of, ZeRO-3 leaf modules, the
``logging`` submodule (ds_logging.py), the ``groups`` submodule (ds_groups.py: the
sequence-parallel group accessors), the ``zero_to_fp32`` submodule (zero_to_fp32.py: the full
fp32 weights of a checkpoint, offline), and the fp32 value accessors (peft's AdaLoRA reads
``safe_get_full_grad``): a parameter's master weights, reduced gradient and optimizer state, in
full or this rank's piece, read and written in the live engine that trains it
(zero/full_values.py, which says when a gradient exists and what it holds).

The ``safe_get_full_*`` readers are collectives over the data-parallel group (every rank calls
them for the same parameter). ``safe_set_full_*`` take the full value, the same on every rank,
and communicate nothing; ``safe_set_local_fp32_param`` is called by every rank with its own piece.
A parameter of no live deepcompile engine is an error (DeepSpeed returns None for it)."""

from __future__ import annotations

from typing import Any, List, Sequence

from deepcompile.integrations.deepspeed_api import ds_groups as groups  # noqa: F401 - deepspeed.utils.groups
from deepcompile.integrations.deepspeed_api import ds_logging as logging  # deepspeed.utils.logging
from deepcompile.integrations.deepspeed_api import zero_to_fp32  # noqa: F401 - deepspeed.utils.zero_to_fp32
from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.ds_logging import log_dist, logger  # noqa: F401
from deepcompile.zero import full_values


def set_z3_leaf_modules(model: Any, leaf_module_classes: Sequence[Any]) -> List[Any]:
    """accelerate calls this for MoE blocks (``transformer_moe_cls_names``): the same meaning
    as :func:`deepcompile.set_leaf_modules` (a leaf's parameters are gathered together)."""
    from deepcompile.zero.leaf_modules import set_leaf_modules  # what deepcompile.set_leaf_modules is

    return set_leaf_modules(model, list(leaf_module_classes))


def _frozen_shard(param: Any) -> bool:
    """A parameter of a served frozen ZeRO-3 engine (a reference model: no master, no gradient)."""
    from deepcompile.integrations.deepspeed_api.frozen_shards import shard_of

    return shard_of(param) is not None


def safe_get_full_fp32_param(param: Any) -> Any:
    """The full fp32 master value of ``param`` (its shape) on every rank; None without a master
    (frozen). Collective."""
    if _frozen_shard(param):
        return None
    return full_values.full_fp32_param(param, "deepspeed.utils.safe_get_full_fp32_param")


def safe_get_full_grad(param: Any) -> Any:
    """The full fp32 gradient of ``param`` averaged over the ranks, fp16's loss scale divided out,
    on every rank: after the backward of an accumulation boundary and before ``step()`` the
    window's gradient (ZeRO-2/3 between micro-steps: the sum so far); None where none exists.
    Refused under ZeRO-1 between micro-steps and with compile.optimizer_step_in_backward.
    Collective."""
    return None if _frozen_shard(param) else full_values.full_grad(param, "deepspeed.utils.safe_get_full_grad")


def safe_get_full_optimizer_state(param: Any, optim_state_key: str) -> Any:
    """Optimizer state ``optim_state_key`` (``exp_avg``, ``exp_avg_sq``) of ``param`` in full, fp32,
    on every rank; None before the first step or without a master. Collective."""
    if _frozen_shard(param):
        return None
    return full_values.full_optimizer_state(param, optim_state_key, "deepspeed.utils.safe_get_full_optimizer_state")


def safe_set_full_fp32_param(param: Any, value: Any) -> None:
    """Write the full fp32 ``value`` (the same on every rank, each rank calls it) into the masters
    and what the next forward computes with."""
    full_values.set_full_fp32_param(param, value, "deepspeed.utils.safe_set_full_fp32_param")


def safe_set_full_optimizer_state(param: Any, value: Any, optim_state_key: str) -> None:
    """Write the full ``value`` (the same on every rank) of optimizer state ``optim_state_key``."""
    full_values.set_full_optimizer_state(param, value, optim_state_key,
                                         "deepspeed.utils.safe_set_full_optimizer_state")


def safe_get_local_fp32_param(param: Any) -> Any:
    """This rank's flat piece of the fp32 master (a copy); None without a master."""
    if _frozen_shard(param):
        return None
    return full_values.local_fp32_param(param, "deepspeed.utils.safe_get_local_fp32_param")


def safe_get_local_grad(param: Any) -> Any:
    """This rank's flat piece of the gradient ``safe_get_full_grad`` returns, or None."""
    return None if _frozen_shard(param) else full_values.local_grad(param, "deepspeed.utils.safe_get_local_grad")


def safe_get_local_optimizer_state(param: Any, optim_state_key: str) -> Any:
    """This rank's flat piece of optimizer state ``optim_state_key`` (a copy), or None."""
    if _frozen_shard(param):
        return None
    return full_values.local_optimizer_state(param, optim_state_key, "deepspeed.utils.safe_get_local_optimizer_state")


def safe_set_local_fp32_param(param: Any, value: Any) -> None:
    """Write this rank's flat piece of the fp32 master; every rank calls it with its own piece."""
    full_values.set_local_fp32_param(param, value, "deepspeed.utils.safe_set_local_fp32_param")


def safe_set_local_optimizer_state(param: Any, value: Any, optim_state_key: str) -> None:
    """Write this rank's flat piece of optimizer state ``optim_state_key``."""
    full_values.set_local_optimizer_state(param, value, optim_state_key,
                                          "deepspeed.utils.safe_set_local_optimizer_state")


__getattr__ = module_getattr("deepspeed.utils")
