"""Sizes HF Trainer and accelerate filled in for ``"auto"``, handed back to deepcompile's own
``"auto"``.

Trainer and accelerate replace ``zero_optimization.reduce_bucket_size: "auto"`` with
``hidden_size ** 2`` and ``stage3_prefetch_bucket_size: "auto"`` with ``int(0.9 * hidden_size ** 2)``
before ``deepspeed.initialize`` sees the config: sizes chosen for DeepSpeed's eager hooks.
deepcompile resolves those ``"auto"``s differently (config/auto.py: one decoder layer's elements
each), because its compiled step pays per reduce bucket and per prefetch group: on the 1B bench
model the Trainer-filled reduce bucket cost 14 ms a step, and the prefetch bucket made every
prefetch group a single parameter (293 host round trips a step). The values arrive as plain
numbers, so the served ``initialize`` recognises them: exactly the value Trainer derives from the
``hidden_size`` of the model it is given is taken as the fill of an ``"auto"`` and resolved by
deepcompile instead (logged, and in the schedule report's ``sizes`` section). A value a user
writes by hand is anything else and is kept as written. ``stage3_param_persistence_threshold``
keeps Trainer's value: deepcompile's ``"auto"`` for it is the same (10 * hidden_size).
"""


from __future__ import annotations

import copy
import logging
from typing import Any, Dict, List, Tuple

from deepcompile.config.auto import hidden_size_of

log = logging.getLogger("deepcompile")


# key -> what HF Trainer/accelerate write for its "auto" (transformers' deepspeed integration)
TRAINER_FILLS = {"reduce_bucket_size": lambda h: h * h,
                 "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h)}


def unfill(config: Dict[str, Any], model: Any) -> Tuple[Dict[str, Any], List[str]]:
    """``config`` with Trainer/accelerate-filled sizes back at ``"auto"`` (a copy; the caller's
    dict is not changed), and the keys so handed back."""
    hidden = hidden_size_of(model)
    zero = config.get("zero_optimization")
    if hidden is None or not isinstance(zero, dict):
        return config, []
    keys = [name for name, fill in TRAINER_FILLS.items()
            if not isinstance(zero.get(name), bool) and isinstance(zero.get(name), (int, float))
            and zero[name] == fill(hidden)]
    if not keys:
        return config, []
    out = copy.deepcopy(config)
    for name in keys:
        out["zero_optimization"][name] = "auto"
    return out, [f"zero_optimization.{name}" for name in keys]


def say_unfilled(keys: List[str], resolved: Any, rank: int) -> None:
    if not keys or rank != 0:
        return
    z = resolved.zero_optimization
    what = {"zero_optimization.reduce_bucket_size": ("reduce_bucket_size", "hidden_size**2"),
            "zero_optimization.stage3_prefetch_bucket_size": ("stage3_prefetch_bucket_size", "0.9*hidden_size**2")}
    parts = [f"{name} {fill} -> {getattr(z, name):,}" for name, fill in (what[k] for k in keys)]
    log.info("deepcompile: HF Trainer/accelerate filled \"auto\" sizes; deepcompile resolves those \"auto\"s "
             "itself (one decoder layer's elements, docs/huggingface.md): %s", "; ".join(parts))
