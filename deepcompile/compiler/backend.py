"""The deepcompile torch.compile backend: what happens to one graph Dynamo captures.

For each graph the backend assigns a fresh graph id (monotonic, never reused, unlike
``id(gm.graph)``), registers an executor of its ZeRO stage for the parameters the graph takes as
inputs, and runs aot_autograd with (ZeRO-3: after turning outputs that view a partitioned parameter into
copies, passes/escaping_views.py):
  * a partitioner that first runs Inductor's joint-graph passes (with Inductor inside) and, for
    ZeRO-3, never saves gathered parameters for backward (compiler/partitioner.py);
  * ZeRO-3: a forward compiler that inserts gather/release (passes/zero3.py);
  * a backward compiler that sends parameter gradients to dc.reduce_grad and returns None for
    them (passes/reduce.py, every stage) and (ZeRO-3) re-gathers;
  * then the inner compiler: FX execution for "eager", Inductor for "inductor".
The forward and backward compilers of one graph are closures over the same graph id and input
slots, which is how the two halves are paired; a recompile of the same frame is a new graph.

Which graph passes run on a half, in which order, is one list (compiler/pipeline.py); re-planning
re-runs its PLAN slice. ZeRO-3's prefetch plan comes from the schedule driver
(scheduling/driver.py). Every compiled half is wrapped so that the driver can run it through the
profiler instead, on the micro-steps it profiles; the wrapper keeps a copy of the graph as it was
before the inner compiler.

Which backend objects exist, and when they are replaced, is ``compiler/compiled_module.py``'s job.
"""

from __future__ import annotations

import functools
import itertools
import logging
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch.fx import GraphModule, Node

from deepcompile import compat, debug_checks, ops, runtime
from deepcompile.compiler import replan
from deepcompile.compiler.graph_instances import GraphInstance, SharedGraph, Template, binding_of
from deepcompile.compiler.partitioner import GRAPH_INPUT_NAME, make_partition_fn
from deepcompile.compiler.pipeline import PIPELINE, HalfContext, Stage
from deepcompile.passes.escaping_views import copy_param_views_in_outputs, custom_op_parameter_inputs
from deepcompile.passes.slot_ops import rebind
from deepcompile.scheduling import planner
from deepcompile.zero.sharding import Sharding

log = logging.getLogger(__name__)

INNER_COMPILERS = ("inductor", "eager")


class GraphRecord:
    """What the backend knows about one captured graph."""

    def __init__(self, graph_id: int, param_slots: Dict[int, int], instances: Dict[int, GraphInstance]):
        self.graph_id = graph_id  # the id of the first instance, which the constant form names
        self.param_slots = param_slots  # Dynamo input index -> ds id
        self.slot_ids = [param_slots[i] for i in sorted(param_slots)]  # ds ids in slot order
        self.graph_input_index: Optional[int] = None  # the forward input that is the instance
        self.instances = instances  # graph id -> instance, every instance of the backend
        self.fw_param_names: Dict[str, int] = {}  # forward placeholder name -> ds id
        self.needs_backward = False
        self.reduced_ids: List[int] = []  # ds ids whose gradients the backward reduces, once each
        self.num_fwd_outputs: Optional[int] = None  # forward outputs the caller sees (the partitioner's)
        self.saved: Dict[str, Any] = {}  # the forward's saved values (passes/saved_values.py)
        self.offload_sites: Dict[str, Any] = {}  # saved value name -> activation offload site


class DeepCompileBackend:
    """Callable handed to torch.compile: compiles every graph of one module for one inner compiler.

    ``ds_id_of`` maps ``id(parameter)`` to its ds id; ``driver`` is the schedule driver (ZeRO-3
    passes and profiling).
    """

    def __init__(self, stage: int, ds_id_of: Dict[int, int], driver: Any, inner: str = "inductor",
                 sharding: Optional[Sharding] = None, activations: Any = None,
                 captured_graph_passes: Sequence[Callable[[GraphModule], Any]] = ()):
        if inner not in INNER_COMPILERS:
            raise ValueError(f"inner compiler must be 'inductor' or 'eager', got {inner!r}")
        self.inner = inner
        self.stage = stage
        self.driver = driver
        self.graphs: List[GraphRecord] = []
        self._next_graph_id = itertools.count(1)  # 0 serves eager frames
        self._ds_id_of = ds_id_of
        # For code that must run eagerly: leaves, graphs run with gathered parameters (ZeRO-3).
        self._sharding = sharding
        self._shared_graphs: List[SharedGraph] = []
        self.instances: Dict[int, GraphInstance] = {}  # graph id -> instance (compiler/graph_instances.py)
        # compile.free_activation / offload_activation (offload/activations.py), or None.
        self.activations = activations
        # Rewrites of the graph Dynamo captured (sequence parallelism's attention pass, the tiled
        # loss), run before everything else, so that aot_autograd traces their backward too.
        self.captured_graph_passes = list(captured_graph_passes)
        compat.mark_ops_side_effectful(ops.SIDE_EFFECTFUL)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "DeepCompileBackend":
        # A backend is one engine's (its runtime, schedule and process group): a copy would be
        # another engine's worth of state, and a process group cannot be copied at all. Lightning
        # deep-copies torch.compile's keyword arguments for every module it sees compiled
        # (lightning.fabric.wrappers), only to pass them to torch.compile again: the backend itself
        # is the right copy.
        return self

    def __call__(self, gm: GraphModule, example_inputs: List[Any]):
        # Dynamo keeps using ``gm`` after this returns: the template compiles a copy (it gains an
        # input), and another copy stays as captured, for other parameter positions.
        for rewrite in self.captured_graph_passes:
            rewrite(gm)
        pristine = _copy_graph_module(gm)
        compiled, first, shared = self._compile_template(_copy_graph_module(gm), list(example_inputs))
        positions = tuple(i for i, _ in binding_of(example_inputs, self._ds_id_of))
        graph = SharedGraph(pristine, Template(compiled, first, positions, shared), self._ds_id_of,
                            self._compile_template, self._new_instance, _copy_graph_module)
        self._shared_graphs.append(graph)
        return graph

    def _new_instance(self, first: GraphInstance, slot_ids: List[int]) -> GraphInstance:
        """Another parameter set for the code compiled with ``first``: a graph id of its own,
        registered with the runtime with ``slot_ids`` (compiler/graph_instances.py)."""
        graph_id = next(self._next_graph_id)
        runtime.register_graph(graph_id, slot_ids, stage=self.stage)
        instance = GraphInstance(graph_id, slot_ids, first.slot_ids, template_graph_id=first.graph_id)
        self.instances[graph_id] = instance
        return instance

    def _compile_template(self, gm: GraphModule, example_inputs: List[Any]):
        """aot_autograd with our compilers, for the parameters found in ``example_inputs``.
        Returns (code taking the inputs plus the instance, the first instance, whether the code
        can run other instances)."""
        slots = {i: self._ds_id_of[id(t)] for i, t in enumerate(example_inputs) if id(t) in self._ds_id_of}
        record = GraphRecord(next(self._next_graph_id), slots, self.instances)
        self.graphs.append(record)
        runtime.register_graph(record.graph_id, record.slot_ids, stage=self.stage)
        first = GraphInstance(record.graph_id, record.slot_ids, record.slot_ids)
        self.instances[record.graph_id] = first
        if self.stage == 3:
            copied = copy_param_views_in_outputs(gm, slots)
            if copied:
                log.debug("graph %d returns views of partitioned parameters to eager code, as copies: %s",
                          record.graph_id, copied)
        record.graph_input_index = len(example_inputs)
        _add_graph_input(gm)
        example_inputs = [*example_inputs, first.graph_tensor]
        partition = make_partition_fn(set(slots) if self.stage == 3 else None, joint_passes=self.inner == "inductor",
                                      on_forward_outputs=functools.partial(setattr, record, "num_fwd_outputs"),
                                      graph_input_index=record.graph_input_index)
        decompositions = None
        if self.inner == "inductor":
            compat.protect_runtime_buffers_in_inductor(ops.INDUCTOR_PROTECTED_BUFFERS)
            decompositions = compat.inductor_decompositions()
        backend = compat.aot_backend(
            fw_compiler=functools.partial(self._compile_forward, record),
            bw_compiler=functools.partial(self._compile_backward, record),
            partition_fn=partition,
            decompositions=decompositions,
        )
        try:
            return backend(gm, example_inputs), first, True
        except Exception:
            fallback = self._graph_not_compiled(gm, slots, example_inputs)
            if fallback is None:
                # Nothing was compiled: Dynamo splits the graph (or restarts the trace) and
                # compiles the pieces as graphs of their own; this record never runs.
                self.graphs.remove(record)
                self.instances.pop(record.graph_id, None)
                raise
            return fallback, first, False

    def _graph_not_compiled(self, gm: GraphModule, slots: Dict[int, int], example_inputs: List[Any]):
        """aot_autograd failed on this graph. Dynamo would split it and run the failing part
        eagerly, where parameters that a custom op of the graph reads are placeholders
        (passes/escaping_views.py). So their modules become leaves: the traces Dynamo restarts
        call them eagerly, with gathered parameters. If such a module is running right now (this
        graph is part of its forward, resumed after a graph break), its current call cannot
        become a leaf call: this graph then runs eagerly, its parameters gathered. Returns that
        runner, or None to let Dynamo split the graph."""
        if self.stage != 3 or self._sharding is None:
            return None
        leaves = self._sharding.run_as_leaves(custom_op_parameter_inputs(gm, example_inputs))
        if not leaves:
            return None
        log.warning(
            "deepcompile: a graph reading partitioned parameters through a custom operator could not be "
            "compiled (Dynamo runs that operator eagerly); these modules now run eagerly with their "
            "parameters gathered, as leaves: %s. Mark them with deepcompile.set_leaf_modules to say so "
            "up front.", ", ".join(name for name, _ in leaves))
        if not _running([module for _, module in leaves]):
            return None
        unbound = [i for i, t in enumerate(example_inputs)
                   if i not in slots and isinstance(t, torch.Tensor)
                   and any(compat.shares_storage(t, example_inputs[j]) for j in slots)]
        if unbound:
            raise RuntimeError(
                f"deepcompile: graph {self.graphs[-1].graph_id} cannot be compiled and takes views of partitioned "
                f"parameters made outside compiled code (inputs {unbound}); run the module that makes them as a "
                "leaf: deepcompile.set_leaf_modules(model, [ModuleClass]) before deepcompile.initialize")
        return self._sharding.run_graph_eagerly(gm, slots)

    def detach(self) -> None:
        """Drop every reference to the engine's state (compiler closures may outlive it)."""
        self.driver = None
        self._ds_id_of = {}
        self._sharding = None
        self.captured_graph_passes = []
        for graph in self._shared_graphs:
            graph.detach()
        self._shared_graphs = []

    # ---- halves ------------------------------------------------------------------------------

    def _compile_forward(self, record: GraphRecord, gm: GraphModule, inputs: List[Any]):
        placeholders = compat.forward_inputs(gm)
        _check_graph_input(placeholders, record.graph_input_index, record.graph_id)
        ctx = self._context(record, "forward", gm)
        for index, ds_id in record.param_slots.items():
            node = placeholders[index]
            ctx.params[node] = ds_id
            record.fw_param_names[node.name] = ds_id
        PIPELINE.run(ctx, [Stage.STRUCTURE])
        return self._finish(ctx, inputs, record.graph_input_index)

    def _compile_backward(self, record: GraphRecord, gm: GraphModule, inputs: List[Any]):
        record.needs_backward = True
        ctx = PIPELINE.run(self._context(record, "backward", gm), [Stage.STRUCTURE])
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        graph_arg = next((i for i, n in enumerate(placeholders) if n.name == GRAPH_INPUT_NAME), None)
        if graph_arg is None:
            raise RuntimeError(f"deepcompile: the backward of graph {record.graph_id} did not receive its instance")
        return self._finish(ctx, inputs, graph_arg)

    def _context(self, record: GraphRecord, phase: str, gm: GraphModule) -> HalfContext:
        act = self.activations
        return HalfContext(gm, phase, record, self.stage, driver=self.driver, activations=act,
                           reload_bytes_per_s=act.bytes_per_s if act is not None else None)

    def _finish(self, ctx: HalfContext, inputs: List[Any], graph_arg: int):
        """The plan's passes (compiler/pipeline.py, the slice a re-plan re-runs), then the inner
        compiler, wrapped for profiling.

        The graph's Python code is generated once, right before the inner compiler; the
        profiler interprets the graph (ids as constants) and needs none. ``graph_arg``: the
        input that is the graph instance."""
        record, phase, gm = ctx.record, ctx.phase, ctx.gm
        signature = planner.graph_signature(phase, gm)
        ctx.signature = signature
        is_backward = phase == "backward"
        half_plan = None
        if self.stage == 3:
            base = _copy_graph_module(gm)
            self.driver.note_graph(signature, base)
            if not replan.has_symbolic_sizes(inputs):  # compiler/replan.py: why not otherwise
                half_plan = replan.HalfPlan(base, record.graph_id, phase,
                                            self._compiler_for_later(record, inputs, is_backward, graph_arg))
        PIPELINE.run(ctx, [Stage.PLAN])
        if half_plan is not None and not record.offload_sites:
            half_plan.key = replan.plan_key(ctx.prefetch_plan)  # the graph is base + this plan
        if half_plan is not None and self.inner == "inductor" and self.driver.wants_profile(signature):
            # Its first run is profiled, and a re-plan may replace it before it runs compiled.
            # Until it compiles, the profiler reads gm itself (interpreting never changes it).
            compiled = None
            profiled_gm = gm
            half_plan.defer(gm)
        else:
            profiled_gm = _copy_graph_module(gm)  # the inner compiler may rewrite gm in place
            _lower_to_slots(record, phase, self.stage, gm, graph_arg)
            compiled = self._inner_compile(gm, inputs, is_backward=is_backward)
            if half_plan is not None:
                half_plan.compiled_now(compiled)
        reduces = record.reduced_ids if is_backward else []
        # compile.optimizer_step_in_backward: the stage's (zero/backward_step.py), told of what
        # each run of a backward half reduced.
        step = self._sharding.backward_step if reduces and self._sharding is not None else None
        return _ProfiledCallable(compiled, profiled_gm, signature, record, self.driver, graph_arg, reduces, half_plan,
                                 backward_step=step)

    def _inner_compile(self, gm: GraphModule, inputs: List[Any], is_backward: bool):
        if self.inner == "eager":
            return compat.boxed(gm.forward)
        return compat.inductor_compile(gm, inputs, is_backward=is_backward, unread_inputs=gathered_only_inputs(gm))

    def _compiler_for_later(self, record: GraphRecord, inputs: List[Any], is_backward: bool,
                            graph_arg: int) -> Callable[[GraphModule], Callable]:
        if self.inner == "eager":
            inner = lambda gm: compat.boxed(gm.forward)  # noqa: E731
        else:
            inner = compat.inductor_compiler_for_later(inputs, is_backward=is_backward,
                                                       unread_inputs=gathered_only_inputs)

        phase, stage = ("backward" if is_backward else "forward"), self.stage

        def compile_later(gm: GraphModule) -> Callable:  # no reference to the backend: it outlives it
            _lower_to_slots(record, phase, stage, gm, graph_arg)
            return inner(gm)

        return compile_later


_GATHERS = (ops.ALLGATHER_PARAM, ops.ALLGATHER_PARAM_SLOT, ops.PREFETCH_PARAMS_FUSED, ops.PREFETCH_PARAMS_FUSED_SLOT)


def gathered_only_inputs(gm: GraphModule) -> List[int]:
    """Positions of the graph's inputs that only the runtime's gathers take (and the output may
    pass on, saved for the backward): ZeRO-3 placeholders, whose storage refuses reads
    (zero/partition.py). The generated code never reads them; the runtime gathers from its shards."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, n in enumerate(inputs)
            if any(u.op == "call_function" for u in n.users)
            and all(u.op == "output" or (u.op == "call_function" and u.target in _GATHERS) for u in n.users)]


def _running(modules: List[Any]) -> bool:
    """True if a forward of one of ``modules`` is on the Python stack (a frame whose ``self``
    is the module)."""
    wanted = {id(m) for m in modules}
    frame = sys._getframe(1)
    while frame is not None:
        if id(frame.f_locals.get("self")) in wanted:
            return True
        frame = frame.f_back
    return False


def _add_graph_input(gm: GraphModule) -> None:
    """Append the graph-instance input to a captured graph (after its last input). aot_autograd
    expects every input of a Dynamo graph to carry a source; this one has none, like the inputs
    of graphs Dynamo's DDP optimizer splits off."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ctx = gm.graph.inserting_after(placeholders[-1]) if placeholders else gm.graph.inserting_before()
    with ctx:
        node = gm.graph.placeholder("dc_graph_instance")
    node._dynamo_source = None
    gm.recompile()


def _check_graph_input(placeholders: List[Node], index: Optional[int], graph_id: int) -> None:
    val = placeholders[index].meta.get("val") if index is not None and index < len(placeholders) else None
    if not (isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype == torch.int64 and val.device.type == "cpu"):
        raise RuntimeError(f"deepcompile: the forward of graph {graph_id} does not take its instance as input "
                           f"{index} (aot_autograd changed the order of the graph's inputs)")


def _lower_to_slots(record: GraphRecord, phase: str, stage: int, gm: GraphModule, graph_arg: int) -> None:
    """The pipeline's last stage: ids become data (passes/slot_ops.py); also generates the graph's code."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    PIPELINE.run(HalfContext(gm, phase, record, stage, graph_input=placeholders[graph_arg]), [Stage.LOWER])


def _copy_graph_module(gm: GraphModule) -> GraphModule:
    """A GraphModule over a copy of ``gm``'s graph (node metadata shallow-copied), same submodules."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return compat.lazy_graph_module(gm, graph)


class _ProfiledCallable:
    """A compiled graph half that the schedule driver can run through the profiler instead.

    torch wraps compiled halves with ``functools.wraps``, which copies the wrapped object's
    ``__dict__`` (not its class attributes) into the wrapper. So the state lives in slots, where a
    copy cannot reach it: otherwise the driver (and through it the engine's whole state) would stay
    referenced by those wrappers after ``engine.destroy()``. The instance ``__dict__`` holds only
    the boxed-call flag (``compat.mark_boxed``), which the wrappers must inherit: it tells
    aot_autograd to pass the arguments as one list, which Inductor's code clears and then frees
    each saved activation after its last use in the backward. Without it the arguments are
    unpacked and every activation saved by the forward stays alive until the whole backward graph
    has run (docs/design/measured.md). ``detach`` drops every reference once the engine is gone.

    ``plan`` (ZeRO-3, static sizes): what re-planning in place needs (``compiler/replan.py``);
    ``compiled`` is None while a compile is pending, done at the next run that is not profiled.
    ``backward_step``: the stage's optimizer step in the backward (``zero/backward_step.py``) for
    a backward half that reduces gradients, else None.
    """

    __slots__ = ("compiled", "gm", "signature", "record", "driver", "graph_arg", "reduces", "plan", "backward_step",
                 "__weakref__", "__dict__")

    def __init__(self, compiled, gm: GraphModule, signature, record: GraphRecord, driver, graph_arg: int,
                 reduces: List[int] = (), plan: Optional[replan.HalfPlan] = None, backward_step: Any = None):
        compat.mark_boxed(self)
        self.compiled = compiled
        self.gm = gm
        self.signature = signature
        self.record = record
        self.driver = driver
        self.graph_arg = graph_arg  # the input that is the graph instance
        self.reduces = list(reduces)  # ds ids (first instance) this half hands to reduce_grad once per run
        self.plan = plan
        self.backward_step = backward_step
        driver.track(self)

    @property
    def can_replan_in_place(self) -> bool:
        return self.plan is not None

    def __call__(self, *args: Any):
        # Boxed (one list, from aot_autograd) or unboxed (a wrapper that did not keep the boxed
        # flag); graph inputs are tensors and symbolic ints, never lists.
        boxed = args[0] if len(args) == 1 and isinstance(args[0], list) else list(args)
        driver = self.driver
        if driver is None:
            raise RuntimeError("deepcompile: this graph belongs to an engine that was destroyed")
        step = self.backward_step
        if step is not None and step.armed:  # compile.optimizer_step_in_backward (zero/backward_step.py)
            instance = self.record.instances[int(boxed[self.graph_arg])]  # read before the run clears boxed
            out = self._run(boxed, driver)
            first = instance.graph_id == self.record.graph_id
            step.after_graph(self.reduces if first else instance.ds_ids(self.reduces))
            return out
        return self._run(boxed, driver)

    def _run(self, boxed: List[Any], driver):
        checking = bool(self.reduces) and debug_checks.LEDGER is not None
        chain = driver.chain
        if driver.mode is None and not checking:
            if chain.links or chain.counting:  # the next units' first gathers, while this one runs
                chain.started(self.signature[0], self.record.instances[int(boxed[self.graph_arg])])
            return self.run_compiled(boxed)
        instance = self.record.instances[int(boxed[self.graph_arg])]
        chain.note(self.signature[0], instance)
        chain.started(self.signature[0], instance)
        first = instance.graph_id == self.record.graph_id
        if checking:
            debug_checks.note_reductions(self.reduces if first else instance.ds_ids(self.reduces))
        signature = self.signature if first else _instance_signature(self.signature, instance)
        if driver.wants_profile(signature):
            gm = self.gm if first else self._rebound(instance, signature)
            return driver.run_profiled(gm, boxed, self.run_compiled, signature, instance.graph_id, instance.slot_ids)
        return self.run_compiled(boxed)

    def _rebound(self, instance: GraphInstance, signature) -> GraphModule:
        """This half's graph (constant form) for another instance, for the profiler; the driver
        also learns the instance's graph, so that its parameters count in the plans."""
        id_map = instance.id_map()
        base = self.plan.base if self.plan is not None else self.gm
        self.driver.note_graph(signature, rebind(base, self.record.graph_id, instance.graph_id, id_map))
        return rebind(self.gm, self.record.graph_id, instance.graph_id, id_map)

    def run_compiled(self, boxed: List[Any]):
        if self.compiled is None:
            self.gm, self.compiled = self.plan.compile_pending()
        return self.compiled(boxed)

    def detach(self) -> None:
        self.compiled = self.gm = self.driver = self.plan = self.backward_step = None


def _instance_signature(signature: tuple, instance: GraphInstance) -> tuple:
    """``planner.graph_signature`` of the first instance's graph, for ``instance``: the same
    graph with its ds ids."""
    phase, gathered, size = signature
    return (phase, tuple(instance.ds_id(i) for i in gathered), size)
