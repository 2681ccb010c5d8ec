"""accelerate's per-layer compilation taken over by deepcompile's own (the line that says what
runs is the engine's: deepcompile/run_summary.py).

accelerate's regional compilation (``dynamo_use_regional_compilation``) calls ``module.compile()``
on every repeated block of the engine's module: plain ``torch.compile`` around deepcompile's eager
ZeRO hooks, so every parameter is still gathered by a hook at use and nothing is scheduled.
:func:`take_over_regional_compile` finds those blocks before the first forward, undoes their
``module.compile()`` and returns their classes, which the engine then compiles as its own
per-layer graphs (``engine.compile(regional=...)``).
"""

from __future__ import annotations

from typing import Any, List

import torch.nn as nn

from deepcompile import compat


def take_over_regional_compile(module: nn.Module, engine: Any) -> List[type]:
    """Classes of the submodules of ``module`` that someone else compiled in place
    (``module.compile()``), each such compile undone; [] when there are none. The engine's own
    per-layer graphs are compiled the same way and are left alone."""
    own = {id(m) for m in engine.compiled_module.regions}
    taken = [m for m in module.modules() if getattr(m, "_compiled_call_impl", None) is not None and id(m) not in own]
    for m in taken:
        compat.drop_module_compile(m)
    return list(dict.fromkeys(type(m) for m in taken))
