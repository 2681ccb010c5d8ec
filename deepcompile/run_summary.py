"""One line, logged once on rank 0 before the first training forward, that says what runs:
deepcompile is the engine, the stage and world (and shard groups), the dtypes of compute, masters
and reductions, what is offloaded, and whether and how the step is compiled, with the pass
schedule.

A user cannot tell from a run's output whether the config's precision, offload and compilation
took effect: a run in fp32 where bf16 was asked for looked like any other (issue 37). The line is
also ``engine.summary_line``, for programs and tests.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from deepcompile.config.rules import parameter_offload_keys

log = logging.getLogger("deepcompile")


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


def _compiled(engine: Any) -> str:
    if engine.compiled_as is None:
        why = ("compile.auto_compile is false" if engine.config.compile.auto_compile is False
               else "engine.compile() was not called")
        return f"uncompiled (eager ZeRO hooks; {why})"
    out = engine.compiled_as.describe()
    entries = [e for e in engine.scheduler.schedule.entries if e.passes]
    if entries:
        out += "; " + ", ".join(f"{' + '.join(sorted(e.passes))} from step {e.step}" for e in entries)
    return out


def describe(engine: Any) -> str:
    """The run summary of a :class:`deepcompile.Engine` (one line)."""
    compute = _compute_dtype(engine)
    reduce = engine.precision.zero3_reduce_dtype if engine.stage == 3 else compute
    layout = f"ZeRO-{engine.stage} over {engine.world_size} rank{'s' if engine.world_size != 1 else ''}"
    if engine.topology.hybrid:
        layout += f" (hybrid: shard groups of {engine.topology.shard_size})"
    return (f"deepcompile engine: {layout}; compute in {_dtype_name(compute)}, fp32 master weights and "
            f"optimizer state, gradients reduced in {_dtype_name(reduce)}; {_offload(engine.config)}; "
            f"{_compiled(engine)}")


def log_once(engine: Any) -> str:
    """Log :func:`describe` on rank 0 (INFO, the ``deepcompile`` logger); returns the line."""
    line = describe(engine)
    if engine.rank == 0:
        log.info("%s", line)
    return line
