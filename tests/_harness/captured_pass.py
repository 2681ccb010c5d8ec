"""Run a model once through ``torch.compile`` with a backend that applies one captured-graph pass
(the tiled loss, the tiled MLP) and then runs the graph as traced: what the engine's backend does
first, without the rest of deepcompile (the engine's bypass of idle hub-kernel routing included,
compat/hub_kernels.py)."""

from __future__ import annotations

from typing import Any, Callable

import torch


def run_with_pass(model: Any, rewrite: Callable[[torch.fx.GraphModule], Any], **inputs: Any) -> Any:
    """``model(**inputs)`` compiled with ``rewrite`` applied to every captured graph; Dynamo's
    caches are reset before and after, so that each call traces afresh."""

    def backend(gm, example_inputs):
        rewrite(gm)
        return gm.forward

    from deepcompile import compat

    compat.bypass_idle_kernel_routing(model)
    torch._dynamo.reset()
    try:
        return torch.compile(model, backend=backend)(**inputs)
    finally:
        torch._dynamo.reset()
