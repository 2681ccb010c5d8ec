"""What a script switched to deepcompile actually runs, said once; and accelerate's per-layer
compilation taken over by deepcompile's own.

A Trainer or accelerate script prints nothing of DeepSpeed's engine by itself, so a user cannot
tell whether the config's precision, offload and compilation took effect (a run in fp32 where
bf16 was asked for looked like any other). The served engine logs one line on rank 0 before its
first training forward (:func:`describe`): that deepcompile is the engine, the stage and world,
the dtypes of compute, masters and reductions, what is offloaded, and whether and how the step is
compiled.

accelerate's regional compilation (``dynamo_use_regional_compilation``) calls ``module.compile()``
on every repeated block of the engine's module: plain ``torch.compile`` around deepcompile's eager
ZeRO hooks, so every parameter is still gathered by a hook at use and nothing is scheduled.
:func:`take_over_regional_compile` finds those blocks before the first forward, undoes their
``module.compile()`` and returns their classes, which the engine then compiles as its own
per-layer graphs (``engine.compile(regional=...)``).
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch
import torch.nn as nn

from deepcompile import compat
from deepcompile.config.rules import parameter_offload_keys

log = logging.getLogger("deepcompile")


def take_over_regional_compile(module: nn.Module, engine: Any) -> List[type]:
    """Classes of the submodules of ``module`` that someone else compiled in place
    (``module.compile()``), each such compile undone; [] when there are none. The engine's own
    per-layer graphs are compiled the same way and are left alone."""
    own = {id(m) for m in engine.compiled_module.regions}
    taken = [m for m in module.modules() if getattr(m, "_compiled_call_impl", None) is not None and id(m) not in own]
    for m in taken:
        compat.drop_module_compile(m)
    return list(dict.fromkeys(type(m) for m in taken))


def _dtype_name(dtype: Optional[torch.dtype]) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else "the model's dtype"


def _compute_dtype(engine: Any) -> Optional[torch.dtype]:
    if engine.precision.param_dtype is not None:
        return engine.precision.param_dtype
    return next((p.dtype for p in engine.module.parameters() if p.is_floating_point()), None)


def _offload(config: Any) -> str:
    kinds = []
    z = config.zero_optimization
    if z.offload_optimizer is not None or config.compile.offload_opt_states:
        kinds.append("optimizer state")
    if parameter_offload_keys(config):
        kinds.append("parameters")
    if config.compile.offload_activation:
        kinds.append("activations")
    return "offload: " + (", ".join(kinds) if kinds else "none")


def describe(engine: Any) -> str:
    """The run summary of a :class:`deepcompile.Engine` (one line)."""
    config = engine.config
    compute = _compute_dtype(engine)
    reduce = engine.precision.zero3_reduce_dtype if engine.stage == 3 else compute
    layout = f"ZeRO-{engine.stage} over {engine.world_size} rank{'s' if engine.world_size != 1 else ''}"
    if engine.topology.hybrid:
        layout += f" (hybrid: shard groups of {engine.topology.shard_size})"
    if engine.compiled_as is not None:
        compiled = engine.compiled_as.describe()
        entries = [e for e in engine.scheduler.schedule.entries if e.passes]
        if entries:
            compiled += "; " + ", ".join(f"{' + '.join(sorted(e.passes))} from step {e.step}" for e in entries)
    else:
        compiled = "uncompiled (eager ZeRO hooks; compile.auto_compile is false)"
    return (f"deepcompile engine: {layout}; compute in {_dtype_name(compute)}, fp32 master weights and "
            f"optimizer state, gradients reduced in {_dtype_name(reduce)}; {_offload(config)}; {compiled}")


def log_once(engine: Any) -> str:
    """Log :func:`describe` on rank 0 (INFO, the ``deepcompile`` logger); returns the line."""
    line = describe(engine)
    if engine.rank == 0:
        log.info("%s", line)
    return line
