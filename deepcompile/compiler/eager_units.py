"""Under regional compilation, the eager side of the step as units of the prefetch chain.

The modules outside the compiled blocks (embedding, final norm, head) run eagerly, their
parameters gathered by the eager hooks (``zero/eager_fallback.py``) at their start. Left alone,
those gathers are issued at use, with nothing to hide them behind, and the first layer's graph
(forward) or the last one's (backward) starts its own first gathers at its head. Here they become
units of the prefetch chain (``scheduling/instance_chain.py``), which then launches them while
the unit before them runs:

* the start of the step (a forward pre-hook on the root module);
* each module outside the blocks that holds partitioned parameters, in the forward at its start
  (a forward pre-hook placed before the eager gather hook, so it sees whether that hook will find
  its parameters in flight), in the backward when the gradient of its output arrives (a hook on
  that output: its backward is about to run, the next layer's after it).

The hooks only report to the chain: they gather nothing themselves. They do nothing while Dynamo
traces, and nothing at all unless the chain records, has links or counts.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence

import torch
import torch.nn as nn

from deepcompile import compat
from deepcompile.scheduling.instance_chain import EagerUnit
from deepcompile.zero.eager_fallback import EAGER_GRAPH_ID

STEP_START_KEY = -1


class EagerUnitHooks:
    """Hooks on ``root`` and on every module outside ``regions`` with parameters in ``ds_id_of``
    (id(param) -> ds id); ``chain()`` returns the chain to report to (None: the engine is gone)."""

    def __init__(self, root: nn.Module, regions: Sequence[nn.Module], ds_id_of: Dict[int, int],
                 chain: Callable[[], Any]):
        self._chain = chain
        inside = {id(m) for region in regions for m in region.modules()}
        self.units: List[EagerUnit] = []
        self._handles = [root.register_forward_pre_hook(self._at(EagerUnit(STEP_START_KEY, "step start")),
                                                         prepend=True)]
        for name, module in root.named_modules():
            if id(module) in inside:
                continue
            params = [p for p in compat.direct_parameters(module).values() if p is not None and id(p) in ds_id_of]
            if not params:
                continue
            unit = EagerUnit(STEP_START_KEY - 1 - len(self.units), name or type(module).__name__,
                             [ds_id_of[id(p)] for p in params], [p.numel() for p in params], EAGER_GRAPH_ID)
            self.units.append(unit)
            self._handles.append(module.register_forward_pre_hook(self._at(unit), prepend=True))
            self._handles.append(module.register_forward_hook(self._after(unit)))

    def _live_chain(self) -> Any:
        if torch.compiler.is_compiling():
            return None
        chain = self._chain()
        return chain if chain is not None and chain.active else None

    def _at(self, unit: EagerUnit) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            chain = self._live_chain()
            if chain is not None:
                chain.note("forward", unit)
                chain.started("forward", unit)
        return hook

    def _after(self, unit: EagerUnit) -> Callable:
        def on_grad(grad: torch.Tensor) -> None:
            chain = self._live_chain()
            if chain is not None:
                chain.note("backward", unit)
                chain.started("backward", unit)

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled() or self._live_chain() is None:
                return
            out = output if isinstance(output, torch.Tensor) else None
            if out is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
                out = output[0]
            if out is not None and out.requires_grad:
                out.register_hook(on_grad)
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

