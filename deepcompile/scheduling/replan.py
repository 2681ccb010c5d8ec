"""Re-planning compiled graph halves in place, and compiling a half only when it first runs compiled.

When the pass schedule switches plans, the only graphs that change are those whose optional
passes (today: the prefetch plan) changed them. Dynamo's captures, aot_autograd's joint graph
and partition, and the ZeRO pass are the same as before the switch. So each compiled half keeps
its graph as it was after the ZeRO pass (``base``) and a compiler that can compile a graph for
the same inputs later (``compile_later``, ``compat.inductor_compiler_for_later``). At the switch
the optional passes are re-applied to a copy of ``base``; a half whose resulting graph is the
one it already runs keeps its compiled code; the others get the new graph, compiled when they
first run compiled (a half that never runs again is never compiled). Nothing is traced again.

A forward half's saved activations may have Inductor-chosen strides, and its backward was
compiled for those: a re-planned forward whose output strides differ keeps its previous graph
and code instead (with a warning); the backward is untouched either way.

A backward compiled while its micro-step is profiled runs through the profiler first: its
Inductor compile is deferred to its first compiled run. With ``warmup_steps`` 1 (profile step 0,
re-plan after it) the plain backward is therefore never compiled at all.

Halves with symbolic input sizes are not re-planned in place: a later compile could add shape
guards that Dynamo never installed. If any live half is such, the module is re-planned the
old way, by compiling it again with a fresh backend (``compiler/compiled_module.py``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch.fx import GraphModule

from deepcompile import compat
from deepcompile.passes.prefetch import apply_prefetch

log = logging.getLogger(__name__)


def has_symbolic_sizes(inputs: Sequence[Any]) -> bool:
    """True if any input is a symbolic int or a tensor with a symbolic size or stride."""
    for x in inputs:
        if isinstance(x, torch.SymInt):
            return True
        if isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*x.shape, *x.stride())):
            return True
    return False


class HalfPlan:
    """What one compiled half needs to be re-planned in place and compiled late.

    ``base``: the graph after the ZeRO pass, before the optional passes; ``compile_later``:
    compiles a graph of this half for its original inputs; ``pending``: the graph to compile at
    the next compiled run (None: ``compiled`` is current); ``strides``: the output strides of
    the compiled forward that the backward was compiled against (None: nothing to keep).
    """

    __slots__ = ("base", "graph_id", "phase", "compile_later", "pending", "fallback", "strides")

    def __init__(self, base: GraphModule, graph_id: int, phase: str, compile_later: Callable[[GraphModule], Callable]):
        self.base = base
        self.graph_id = graph_id
        self.phase = phase
        self.compile_later = compile_later
        self.pending: Optional[GraphModule] = None
        self.fallback: Optional[Tuple[GraphModule, Callable]] = None  # (graph, code) to keep on a stride mismatch
        self.strides: Optional[List[Any]] = None

    def defer(self, gm: GraphModule) -> None:
        self.pending = gm

    def compiled_now(self, compiled: Callable) -> None:
        """``compiled`` is the code the half runs from now on (a forward's strides are kept)."""
        if self.phase == "forward" and self.strides is None:
            self.strides = compat.compiled_output_strides(compiled)

    def compile_pending(self, current_gm: GraphModule) -> Tuple[GraphModule, Callable]:
        """Compile the pending graph; returns (profiled graph, code) the half runs from now on."""
        gm, self.pending = self.pending, None
        profiled = _copy(gm)  # the inner compiler may rewrite gm in place
        compiled = self.compile_later(gm)
        fallback, self.fallback = self.fallback, None
        if self.phase == "forward" and self.strides is not None and fallback is not None:
            strides = compat.compiled_output_strides(compiled)
            if strides != self.strides:
                log.warning("deepcompile: graph %d: the re-planned forward lays out its outputs differently from the "
                            "forward its backward was compiled for; it keeps its previous plan", self.graph_id)
                return fallback
        self.compiled_now(compiled)
        return profiled, compiled


def replan(half: Any, driver: Any) -> bool:
    """Re-apply the optional passes of the driver's current plan to ``half`` (a
    ``compiler.backend._ProfiledCallable`` with a ``plan``); True if its graph changed."""
    plan_state: HalfPlan = half.plan
    gm = _copy(plan_state.base)
    plan = driver.prefetch_plan(gm, half.signature)
    if plan is not None:
        apply_prefetch(gm, plan_state.graph_id, plan)
    gm.recompile()
    if gm.code == half.gm.code:
        return False  # same graph: keep the compiled code (or the deferred compile)
    if half.compiled is not None:
        plan_state.fallback = (half.gm, half.compiled)
    half.gm = _copy(gm)
    half.compiled = None
    plan_state.defer(gm)
    return True


def replan_in_place(halves: Sequence[Any], driver: Any) -> int:
    """Re-plan every half; returns how many changed (and will compile at their next compiled run)."""
    return sum(replan(h, driver) for h in halves)


def _copy(gm: GraphModule) -> GraphModule:
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return GraphModule(gm, graph)
