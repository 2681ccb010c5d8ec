"""Sizes HF Trainer and accelerate filled in for ``"auto"``, handed back to deepcompile's own
``"auto"``.

Trainer and accelerate replace ``zero_optimization.reduce_bucket_size: "auto"`` with
``hidden_size ** 2`` before ``deepspeed.initialize`` sees the config: a size chosen for DeepSpeed's
eager reduce path. deepcompile resolves that ``"auto"`` differently (config/auto.py: one decoder
layer's elements), because its compiled backward pays per bucket; on the 1B bench model the
Trainer-filled value cost 14 ms a step. The value arrives as a plain number, so the served
``initialize`` recognises it: exactly ``hidden_size ** 2`` of the model it is given is taken as
the fill of an ``"auto"`` and resolved by deepcompile instead (logged, and in the schedule
report's ``sizes`` section). A value a user writes by hand is anything else and is kept as written.
``stage3_prefetch_bucket_size`` and ``stage3_param_persistence_threshold`` keep Trainer's values:
deepcompile's ``"auto"`` for them is the same.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Dict, List, Tuple

from deepcompile.config.auto import hidden_size_of

log = logging.getLogger("deepcompile")


def unfill(config: Dict[str, Any], model: Any) -> Tuple[Dict[str, Any], List[str]]:
    """``config`` with a Trainer/accelerate-filled ``reduce_bucket_size`` back at ``"auto"`` (a
    copy; the caller's dict is not changed), and the keys so handed back."""
    hidden = hidden_size_of(model)
    zero = config.get("zero_optimization")
    if hidden is None or not isinstance(zero, dict):
        return config, []
    value = zero.get("reduce_bucket_size")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != hidden * hidden:
        return config, []
    out = copy.deepcopy(config)
    out["zero_optimization"]["reduce_bucket_size"] = "auto"
    return out, ["zero_optimization.reduce_bucket_size"]


def say_unfilled(keys: List[str], resolved: Any, rank: int) -> None:
    if keys and rank == 0:
        log.info("deepcompile: zero_optimization.reduce_bucket_size is hidden_size**2, as HF Trainer/accelerate fill "
                 "\"auto\"; deepcompile resolves that \"auto\" itself: %s elements (one decoder layer; "
                 "docs/huggingface.md)", f"{resolved.zero_optimization.reduce_bucket_size:,}")
