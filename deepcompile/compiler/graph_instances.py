"""One Dynamo graph, compiled once and run for every set of parameters it is called with.

Dynamo caches compiled code per code object and guards on tensor metadata, not identity: a frame
that several layers run (identical decoder layers compiled one by one, as FSDP2 users do; the
resumed half of a layer after a graph break; a helper taking a weight as an argument) is
captured once and then called with the next layer's parameters. The runtime ops must then act
on *those* parameters: gather them, and reduce their gradients into their own partitions.

So the compiled graph does not carry ds ids as constants. It takes one more input, the
*instance*: a zero-dimensional int64 CPU tensor holding a graph id, registered with the runtime
with the ds ids of one parameter set in slot order (slot i: the i-th parameter input). Its ops
name parameters by slot (``passes/slot_ops.py``), and its backward receives the instance as a
saved value (``compiler/partitioner.py``). The callable handed back to Dynamo looks up the
instance of the parameters it receives, registering a new one the first time a set is seen (no
tracing, no compile: one ``register_graph``), and passes it as the last input. Every instance has
its own graph id, so release counts and reductions stay per instance, as they were per graph.

Only a call whose parameters sit at other input positions than the first call's (a tensor that
was a parameter is now an activation, or the reverse) needs another compile: a *template* of its
own, from the captured graph as Dynamo handed it over.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.fx import GraphModule

log = logging.getLogger(__name__)

# (graph input index, ds id) of every parameter input, in input order.
Binding = Tuple[Tuple[int, int], ...]


def binding_of(inputs: Sequence[Any], ds_id_of: Dict[int, int]) -> Binding:
    return tuple((i, ds_id_of[id(t)]) for i, t in enumerate(inputs) if id(t) in ds_id_of)


class GraphInstance:
    """One parameter set of a compiled graph: its graph id and ds ids in slot order."""

    __slots__ = ("graph_id", "slot_ids", "graph_tensor", "template_graph_id", "_from_template")

    def __init__(self, graph_id: int, slot_ids: Sequence[int], template_ids: Sequence[int],
                 template_graph_id: Optional[int] = None):
        self.graph_id = graph_id
        self.slot_ids = list(slot_ids)
        # The first instance of the compiled graph (whose constants the passes and plans name).
        self.template_graph_id = graph_id if template_graph_id is None else template_graph_id
        self.graph_tensor = torch.tensor(graph_id, dtype=torch.int64)  # zero-dimensional, on the host
        self._from_template = dict(zip(template_ids, self.slot_ids))

    def ds_id(self, template_id: int) -> int:
        """This instance's ds id in the slot where the template has ``template_id``."""
        return self._from_template[template_id]

    def ds_ids(self, template_ids: Sequence[int]) -> List[int]:
        return [self._from_template[i] for i in template_ids]

    def id_map(self) -> Dict[int, int]:
        """Template ds id -> this instance's."""
        return dict(self._from_template)


class Template:
    """A compiled graph and its instances. ``compiled`` takes the captured graph's inputs plus
    the instance; ``shared`` is False for code that cannot take another parameter set (the eager
    runner of a graph that could not be compiled)."""

    def __init__(self, compiled: Callable, first: GraphInstance, positions: Tuple[int, ...], shared: bool):
        self.compiled = compiled
        self.positions = positions
        self.shared = shared
        self.first = first
        self.instances: Dict[Tuple[int, ...], GraphInstance] = {tuple(first.slot_ids): first}


class SharedGraph:
    """What Dynamo calls for one captured graph.

    ``compile_template(gm, inputs)`` compiles a copy of the captured graph for the parameters in
    ``inputs`` and returns ``(compiled, first instance, shared)``; ``new_instance(first instance,
    ds ids)`` registers another parameter set of a compiled graph."""

    def __init__(self, pristine: GraphModule, template: Template, ds_id_of: Dict[int, int],
                 compile_template: Callable[[GraphModule, List[Any]], Tuple[Callable, GraphInstance, bool]],
                 new_instance: Callable[[GraphInstance, Sequence[int]], GraphInstance],
                 copy_graph: Callable[[GraphModule], GraphModule]):
        self._pristine = pristine
        self._first = template
        self._ds_id_of = ds_id_of
        self._compile_template = compile_template
        self._new_instance = new_instance
        self._copy_graph = copy_graph
        self._others: Dict[Tuple, Template] = {}  # templates for other parameter positions

    def __call__(self, *args: Any):
        if self._compile_template is None:
            raise RuntimeError("deepcompile: this graph belongs to an engine that was destroyed")
        template = self._first
        ds_id_of = self._ds_id_of
        ids = tuple(ds_id_of.get(id(args[i])) for i in template.positions)
        instance = template.instances.get(ids)
        if instance is None:
            template, instance = self._instance_for(args, ids)
        return template.compiled(*args, instance.graph_tensor)

    def _instance_for(self, args: Sequence[Any], ids: Tuple) -> Tuple[Template, GraphInstance]:
        binding = binding_of(args, self._ds_id_of)
        positions = tuple(i for i, _ in binding)
        first = self._first
        if positions == first.positions and first.shared:
            instance = self._new_instance(first.first, ids)
            first.instances[ids] = instance
            log.debug("deepcompile: graph %d runs for another parameter set as graph %d", first.first.graph_id,
                      instance.graph_id)
            return first, instance
        key = self._other_key(args, binding, shared_positions=positions if first.shared else None)
        template = self._others.get(key)
        if template is None:
            compiled, instance, shared = self._compile_template(self._copy_graph(self._pristine), list(args))
            template = Template(compiled, instance, positions, shared)
            self._others[key] = template
            return template, instance
        ids = tuple(ds_id for _, ds_id in binding)
        instance = template.instances.get(ids)
        if instance is None:
            if not template.shared:
                raise AssertionError("an unshared template is keyed by its whole binding")
            instance = self._new_instance(template.first, ids)
            template.instances[ids] = instance
        return template, instance

    @staticmethod
    def _other_key(args: Sequence[Any], binding: Binding, shared_positions: Optional[Tuple[int, ...]]) -> Tuple:
        # A template compiled here sees concrete inputs: with symbolic sizes in the captured
        # graph, it is specialised to the sizes it was compiled for.
        key: Tuple = shared_positions if shared_positions is not None else binding
        if any(isinstance(a, (int, torch.SymInt)) for a in args):
            key += tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
        return key

    def detach(self) -> None:
        self._first = None
        self._others = {}
        self._ds_id_of = {}
        self._compile_template = None
        self._new_instance = None
