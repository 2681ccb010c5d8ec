"""The three batch-size keys, completed as DeepSpeed completes them: any two determine the third
(``train_batch_size = micro * gradient_accumulation_steps * world_size``), one of them may be
``"auto"``, and ``gradient_accumulation_steps`` alone defaults to 1."""

from __future__ import annotations

from typing import Dict, Optional

from deepcompile.config.errors import ConfigError, is_auto
from deepcompile.config.validators import integer

_NAMES = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def complete_batch_sizes(config, world_size: int) -> Dict[str, Optional[int]]:
    """train_batch_size, micro-batch size and accumulation steps for ``world_size`` ranks."""
    world = integer(1)(world_size, "world_size")
    tbs, micro, gas = (getattr(config, name) for name in _NAMES)
    autos = [k for k in _NAMES if is_auto(getattr(config, k))]
    if len(autos) > 1:
        # One message under each key (callers look problems up by key), worded the same for all so
        # that reports listing distinct messages print it once.
        message = (f"{', '.join(autos[:-1])} and {autos[-1]} are \"auto\": at most one of train_batch_size, "
                   "train_micro_batch_size_per_gpu and gradient_accumulation_steps can be derived from the others "
                   "(HF Trainer fills them from per_device_train_batch_size and gradient_accumulation_steps: "
                   "`deepcompile check CONFIG --trainer` checks a config as Trainer hands it over)")
        raise ConfigError([(k, message) for k in autos])
    if autos:
        name = autos[0]
        needs = {"train_batch_size": ("train_micro_batch_size_per_gpu",),
                 "train_micro_batch_size_per_gpu": ("train_batch_size",),
                 "gradient_accumulation_steps": ("train_batch_size", "train_micro_batch_size_per_gpu")}[name]
        missing = [k for k in needs if getattr(config, k) is None]
        if missing:
            raise ConfigError([(name, f"{name} is \"auto\" but {' and '.join(missing)} is not given, so it "
                                      "cannot be derived")])
        if name == "train_batch_size":
            tbs = None
        elif name == "train_micro_batch_size_per_gpu":
            micro = None
        else:
            gas = None
    if tbs is not None and micro is not None and gas is not None:
        if tbs != micro * gas * world:
            raise ConfigError([("train_batch_size", (
                f"train_batch_size ({tbs}) must equal train_micro_batch_size_per_gpu ({micro}) * "
                f"gradient_accumulation_steps ({gas}) * world size ({world}) = {micro * gas * world}"))])
    elif tbs is not None and micro is not None:
        if tbs % (micro * world):
            raise ConfigError([("train_batch_size", (
                f"train_batch_size ({tbs}) must be divisible by train_micro_batch_size_per_gpu ({micro}) * "
                f"world size ({world}) = {micro * world}"))])
        gas = tbs // (micro * world)
    elif tbs is not None:
        gas = gas if gas is not None else 1
        if tbs % (gas * world):
            raise ConfigError([("train_batch_size", (
                f"train_batch_size ({tbs}) must be divisible by gradient_accumulation_steps ({gas}) * "
                f"world size ({world}) = {gas * world}"))])
        micro = tbs // (gas * world)
    elif micro is not None:
        gas = gas if gas is not None else 1
        tbs = micro * gas * world
    else:
        gas = gas if gas is not None else 1
    return {"train_batch_size": tbs, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}
