"""The "deepcompile" torch.compile backend.

For each graph Dynamo captures, the backend assigns a fresh graph id (monotonic, never reused,
unlike ``id(gm.graph)``), registers an executor of the engine's ZeRO stage for the parameters the
graph takes as inputs, and runs aot_autograd with:
  * a partitioner that first runs Inductor's joint-graph passes (with Inductor inside) and, for
    ZeRO-3, never saves gathered parameters for backward (compiler/partitioner.py);
  * ZeRO-3: a forward compiler that inserts gather/release (passes/zero3.py);
  * a backward compiler that (ZeRO-3) re-gathers, and (all stages) sends parameter gradients to
    dc.reduce_grad and returns None for them;
  * then the inner compiler: FX execution for "eager", Inductor for "inductor".
The forward and backward compilers of one graph are closures over the same graph id and input
slots, which is how the two halves are paired; a recompile of the same frame is a new graph.

ZeRO-3's optional passes come from the engine's schedule driver (scheduling/driver.py): the
backend asks it which passes are in force and for each graph's prefetch plan. Every compiled
half is wrapped so that the driver can run it through the profiler instead, on the micro-steps it
profiles; the wrapper keeps a copy of the graph as it was before the inner compiler.
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Any, Dict, List, Optional

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.fx import GraphModule, Node

from deepcompile import compat, runtime
from deepcompile.compiler.partitioner import make_partition_fn
from deepcompile.passes.zero3 import insert_gather_release, insert_reductions
from deepcompile.scheduling import planner

log = logging.getLogger(__name__)


class GraphRecord:
    """What the backend knows about one captured graph."""

    def __init__(self, graph_id: int, param_slots: Dict[int, int]):
        self.graph_id = graph_id
        self.param_slots = param_slots  # Dynamo input index -> ds id
        self.fw_param_names: Dict[str, int] = {}  # forward placeholder name -> ds id
        self.needs_backward = False


def _input_placeholders(gm: GraphModule) -> List[Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


class DeepCompileBackend:
    """Callable handed to torch.compile; one instance per engine."""

    def __init__(self, engine: Any, inner: str = "inductor"):
        if inner not in ("inductor", "eager"):
            raise ValueError(f"inner compiler must be 'inductor' or 'eager', got {inner!r}")
        self.engine = engine
        self.inner = inner
        self.graphs: List[GraphRecord] = []
        self._next_graph_id = itertools.count(1)  # 0 serves eager frames
        self.stage = engine.stage
        self.driver = engine.scheduler
        self._ds_id_of = engine.sharding.ds_id_of
        compat.mark_ops_side_effectful()

    def __call__(self, gm: GraphModule, example_inputs: List[Any]):
        slots = {i: self._ds_id_of[id(t)] for i, t in enumerate(example_inputs) if id(t) in self._ds_id_of}
        record = GraphRecord(next(self._next_graph_id), slots)
        self.graphs.append(record)
        runtime.register_graph(record.graph_id, sorted(set(slots.values())), stage=self.stage)
        partition = make_partition_fn(min_cut_rematerialization_partition,
                                      set(slots) if self.stage == 3 else None,
                                      joint_passes=self.inner == "inductor")
        fw = functools.partial(self._compile_forward, record)
        bw = functools.partial(self._compile_backward, record)
        kwargs: Dict[str, Any] = dict(fw_compiler=fw, bw_compiler=bw, inference_compiler=fw, partition_fn=partition)
        if self.inner == "inductor":
            from torch._inductor.decomposition import select_decomp_table

            compat.protect_runtime_buffers_in_inductor()
            kwargs["decompositions"] = select_decomp_table()
        return aot_autograd(**kwargs)(gm, example_inputs)

    # ---- halves ------------------------------------------------------------------------------

    def _compile_forward(self, record: GraphRecord, gm: GraphModule, inputs: List[Any]):
        placeholders = _input_placeholders(gm)
        params: Dict[Node, int] = {}
        for index, ds_id in record.param_slots.items():
            node = placeholders[index]
            params[node] = ds_id
            record.fw_param_names[node.name] = ds_id
        if self.stage == 3:
            insert_gather_release(gm, record.graph_id, params)
        return self._finish(record, "forward", gm, inputs)

    def _compile_backward(self, record: GraphRecord, gm: GraphModule, inputs: List[Any]):
        record.needs_backward = True
        # Reductions first: a release whose last use is pointwise can then be anchored on the
        # reduction that consumes its result (passes/zero3.py) instead of splitting that region.
        insert_reductions(gm, record.graph_id, record.param_slots)
        if self.stage == 3:
            params = {n: record.fw_param_names[n.name] for n in _input_placeholders(gm) if n.name in record.fw_param_names}
            insert_gather_release(gm, record.graph_id, params)
        return self._finish(record, "backward", gm, inputs)

    def _finish(self, record: GraphRecord, phase: str, gm: GraphModule, inputs: List[Any]):
        """Schedule-driven passes, then the inner compiler, wrapped for profiling."""
        gm.recompile()
        signature = planner.graph_signature(phase, gm)
        if self.stage == 3:
            self.driver.note_graph(signature, _copy_graph_module(gm))
            plan = self.driver.prefetch_plan(gm, signature)
            if plan is not None:
                planner.apply_prefetch(gm, record.graph_id, plan)
                gm.recompile()
        profiled_gm = _copy_graph_module(gm)  # the inner compiler may rewrite gm in place
        compiled = self._inner_compile(gm, inputs, is_backward=phase == "backward")
        return _ProfiledCallable(compiled, profiled_gm, signature, record, self.driver)

    def _inner_compile(self, gm: GraphModule, inputs: List[Any], is_backward: bool):
        if self.inner == "eager":
            from functorch.compile import make_boxed_func

            return make_boxed_func(gm.forward)
        from torch._inductor.compile_fx import compile_fx_inner

        return compile_fx_inner(gm, inputs, is_backward=is_backward)


def _copy_graph_module(gm: GraphModule) -> GraphModule:
    """A GraphModule over a copy of ``gm``'s graph (node metadata shallow-copied), same submodules."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copy = GraphModule(gm, graph)
    return copy


class _ProfiledCallable:
    """A compiled graph half that the schedule driver can run through the profiler instead.

    torch wraps compiled halves with ``functools.wraps``, which copies the wrapped object's
    ``__dict__`` (not its class attributes) into the wrapper. So the state lives in slots, where a
    copy cannot reach it: otherwise the driver (and through it the engine's whole state) would stay
    referenced by those wrappers after ``engine.destroy()``. The instance ``__dict__`` holds only
    ``_boxed_call``, which the wrappers must inherit: it tells aot_autograd to pass the arguments as
    one list, which Inductor's code clears and then frees each saved activation after its last use
    in the backward. Without it the arguments are unpacked and every activation saved by the
    forward stays alive until the whole backward graph has run (on a 1B Llama, GiBs of peak).
    ``detach`` drops every reference once the engine is gone.
    """

    __slots__ = ("compiled", "gm", "signature", "record", "driver", "__weakref__", "__dict__")

    def __init__(self, compiled, gm: GraphModule, signature, record: GraphRecord, driver):
        self._boxed_call = True
        self.compiled = compiled
        self.gm = gm
        self.signature = signature
        self.record = record
        self.driver = driver
        driver.track(self)

    def __call__(self, *args: Any):
        # Boxed (one list, from aot_autograd) or unboxed (a wrapper that did not keep
        # _boxed_call); graph inputs are tensors and symbolic ints, never lists.
        boxed = args[0] if len(args) == 1 and isinstance(args[0], list) else list(args)
        if self.driver is None:
            raise RuntimeError("deepcompile: this graph belongs to an engine that was destroyed")
        if self.driver.wants_profile(self.signature):
            return self.driver.run_profiled(self.gm, boxed, self.compiled, self.signature, self.record.graph_id,
                                            list(self.record.param_slots.values()))
        return self.compiled(boxed)

    def detach(self) -> None:
        self.compiled = self.gm = self.driver = None


def detach_backend(backend: DeepCompileBackend) -> None:
    """Drop the backend's references to its engine (compiler closures may outlive the engine)."""
    backend.engine = backend.driver = None
    backend._ds_id_of = {}


def make_backend(engine: Any, inner: str = "inductor") -> DeepCompileBackend:
    return DeepCompileBackend(engine, inner)


def deepcompile_backend(gm: GraphModule, example_inputs: List[Any], options: Optional[Dict[str, Any]] = None):
    """``torch.compile(engine.module, backend="deepcompile")``: compiles for the active engine.

    ``options={"inner": "eager"}`` selects the FX executor instead of Inductor.
    """
    from deepcompile.engine import active_engine

    options = dict(options or {})
    inner = options.pop("inner", "inductor")
    if options:
        raise ValueError(f"unknown deepcompile backend options {sorted(options)}; supported: ['inner']")
    return active_engine().backend_for(inner)(gm, example_inputs)
