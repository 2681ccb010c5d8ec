"""Re-planning compiled graph halves in place, and compiling a half only when it first runs compiled.

When the pass schedule switches plans, the only graphs that change are those whose optional
passes (the ``PLAN`` stage of ``compiler/pipeline.py``: prefetch, activation reload placement)
changed them. Dynamo's captures, aot_autograd's joint graph
and partition, and the ZeRO pass are the same as before the switch. So each compiled half keeps
its graph as it was before the ``PLAN`` stage (``base``) and a compiler that can compile a graph for
the same inputs later (``compile_later``, ``compat.inductor_compiler_for_later``). At the switch
the ``PLAN`` stage of the same pipeline re-runs on a copy of ``base``; a half whose resulting graph is the
one it already runs keeps its compiled code; the others get the new graph, compiled when they
first run compiled (a half that never runs again is never compiled). Nothing is traced again.

A half compiled while its micro-step is profiled runs through the profiler first: its Inductor
compile is deferred to its first compiled run. With ``warmup_steps`` 1 (profile step 0, re-plan
after it) the plain graphs are therefore never compiled at all.

A forward's saved activations may get Inductor-chosen strides, and its backward is compiled for
the strides the forward first had: Inductor's, or the eager ones when the first forward compile
was deferred. Outputs of a later forward compile whose strides differ are copied into those (in
practice the compute, hence the layout, is the same: the plans only add communication ops).

Halves with symbolic input sizes are not re-planned in place: a later compile could add shape
guards that Dynamo never installed. If any live half is such, the module is re-planned the
old way, by compiling it again with a fresh backend (``compiler/compiled_module.py``).

It lives beside the compiled halves it edits (``compiler/backend.py``) and is used through
``__all__`` alone. Of the schedule it reads only :class:`PlanSource`, which
``scheduling/driver.py``'s driver satisfies: the scheduler decides plans, this module applies them.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch
from torch.fx import GraphModule

from deepcompile import compat
from deepcompile.compiler import pipeline
from deepcompile.offload import bandwidth

__all__ = ["HalfPlan", "PlanSource", "has_symbolic_sizes", "plan_key", "replan", "replan_in_place"]

log = logging.getLogger(__name__)


class PlanSource(Protocol):
    """What re-planning reads of the schedule (``scheduling.driver.ScheduleDriver``)."""

    device: torch.device  # for the host-to-device bandwidth that places activation reloads
    profiles: Mapping[Any, Any]  # graph signature -> its profile (``profiling/graph_profiler.py``)
    chain: Any  # ``scheduling/instance_chain.py``: ``set_head(phase, graph_id, plan)``

    def prefetch_plan(self, gm: GraphModule, signature: Any) -> Any:
        """The current plan's prefetch plan for ``gm`` (None: no prefetching)."""


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

    ``base``: the graph before the pipeline's ``PLAN`` stage; ``compile_later``:
    compiles a graph of this half for its original inputs; ``pending``: the graph to compile at
    the next compiled run (None: the half's code is current); ``strides`` (forward halves): per
    output, the strides its backward was compiled against (None: not known or not a tensor);
    ``key``: the ``plan_key`` of the prefetch plan the half's graph was built with (None: not
    known, e.g. activation reloads were placed too; the graphs' code is then compared).
    """

    __slots__ = ("base", "graph_id", "phase", "compile_later", "pending", "strides", "key")

    def __init__(self, base: GraphModule, graph_id: int, phase: str, compile_later: Callable[[GraphModule], Callable]):
        self.base = base
        self.graph_id = graph_id
        self.phase = phase
        self.compile_later = compile_later
        self.pending: Optional[GraphModule] = None
        self.strides: Optional[List[Optional[Tuple[int, ...]]]] = None
        self.key: Optional[Tuple] = None

    def defer(self, gm: GraphModule) -> None:
        """Compile ``gm`` at the next compiled run instead of now."""
        if self.phase == "forward" and self.strides is None:
            # No forward was compiled yet, so aot_autograd heard of no Inductor strides and
            # compiles the backward for the eager strides of the saved activations.
            self.strides = eager_output_strides(gm)
        self.pending = gm

    def compiled_now(self, compiled: Callable) -> None:
        """``compiled``, the first code of a forward half, sets the strides its backward expects."""
        if self.phase == "forward" and self.strides is None:
            self.strides = inductor_output_strides(compiled)

    def compile_pending(self) -> Tuple[GraphModule, Callable]:
        """Compile the pending graph; returns (profiled graph, code) the half runs from now on."""
        gm, self.pending = self.pending, None
        profiled = _copy(gm)  # the inner compiler may rewrite gm in place
        gm.recompile()  # its code was left stale by the passes (the profiler needs none)
        compiled = self.compile_later(gm)
        if self.phase == "forward" and self.strides is not None:
            compiled = _with_strides(compiled, self.strides, inductor_output_strides(compiled), self.graph_id)
        return profiled, compiled


def eager_output_strides(gm: GraphModule) -> List[Optional[Tuple[int, ...]]]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    vals = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in out]
    return [tuple(v.stride()) if isinstance(v, torch.Tensor) else None for v in vals]


def inductor_output_strides(compiled: Callable) -> Optional[List[Optional[Tuple[int, ...]]]]:
    """Per output, the strides Inductor gave it (None: unknown); None for code that is not
    Inductor's (the FX executor keeps eager strides)."""
    strides = compat.compiled_output_strides(compiled)
    if strides is None:
        return None
    out = []
    for s in strides:
        try:
            out.append(tuple(int(x) for x in s) if s is not None else None)
        except (TypeError, ValueError):  # symbolic: not compared
            out.append(None)
    return out


def _with_strides(compiled: Callable, wanted: List, got: Optional[List], graph_id: int) -> Callable:
    """``compiled``, with each output whose strides differ from ``wanted`` copied into them."""
    if got is None:
        return compiled
    fix = [i for i, (w, g) in enumerate(zip(wanted, got)) if w is not None and g is not None and w != g]
    if not fix:
        return compiled
    # Costs a copy per output and step: say so (Inductor pads strides of some shapes on GPUs).
    log.warning("deepcompile: graph %d: forward outputs %s are copied into the strides its backward was compiled "
                "for, at every step", graph_id, fix)

    def restrided(args: List[Any]):
        outs = list(compiled(args))
        for i in fix:
            t = outs[i]
            outs[i] = torch.empty_strided(t.shape, wanted[i], dtype=t.dtype, device=t.device).copy_(t)
        return outs

    return restrided


def plan_key(plan: Any) -> Tuple:
    """What a prefetch plan writes into a graph (``passes/prefetch.py``): per group, its launch
    point and its gathers. The same key on the same base graph gives the same graph."""
    if plan is None:
        return ()
    return tuple((group.launch_before, tuple((g.node.args[0].name, g.ds_id, g.dtype) for g in group.gathers))
                 for group in plan.groups)


def replan(half: Any, driver: PlanSource) -> bool:
    """Re-run the pipeline's ``PLAN`` stage for the driver's current plan on ``half`` (a
    ``compiler.backend._ProfiledCallable`` with a ``plan``); True if its graph changed.

    A half whose graph is its base plus a prefetch plan compares plans: no copy, no code
    generated when they agree. Others (activation reloads placed from a profile) build the new
    graph and compare its code."""
    plan_state: HalfPlan = half.plan
    if plan_state.key is not None:
        key = plan_key(driver.prefetch_plan(plan_state.base, half.signature))
        if key == plan_state.key:
            return False  # same graph: keep the compiled code (or the deferred compile)
    gm = _copy(plan_state.base)
    # The plan's slice of the backend's passes (prefetch, activation reload placement), as at compile time.
    zero_stage = 3  # halves are re-planned in place under ZeRO-3 alone
    ctx = pipeline.HalfContext(gm, plan_state.phase, half.record, zero_stage, driver=driver, signature=half.signature,
                               reload_bytes_per_s=lambda: bandwidth.host_to_device_bytes_per_s(driver.device))
    plan = pipeline.PIPELINE.run(ctx, [pipeline.Stage.PLAN]).prefetch_plan
    if plan_state.key is None:
        gm.recompile()
        half.gm.recompile()  # its code may be stale (passes ran after its last code generation)
        if gm.code == half.gm.code:
            return False
    else:
        plan_state.key = plan_key(plan)
    half.gm = gm  # profiled as it is; compile_pending copies it before the inner compiler
    half.compiled = None
    plan_state.defer(gm)
    return True


def replan_in_place(halves: Sequence[Any], driver: PlanSource) -> int:
    """Re-plan every half; returns how many changed (and will compile at their next compiled run)."""
    return sum(replan(h, driver) for h in halves)


def _copy(gm: GraphModule) -> GraphModule:
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return GraphModule(gm, graph)
