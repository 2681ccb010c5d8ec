"""The last pass before the inner compiler: graph and ds ids become data, so one compiled graph
serves every parameter set it is called with.

Every pass before this one, the profiler and the planner read the runtime ops with their graph
id and ds id as constants (``dc.allgather_param(param, graph_id, ds_id)``): the ids of the graph's
first parameter set. Compiled code, however, is shared by every parameter set the captured graph
runs for (``compiler/graph_instances.py``): identical decoder layers, compiled once. So the
compiled graph names its instance by an input, a zero-dimensional int64 CPU tensor holding the
instance's graph id, and each parameter by its *slot*, its position among the graph's parameter
inputs; the runtime registered each instance's ds ids in slot order. The ops' ``slot`` overloads
(csrc/ops.cpp) read both on the host.

``rebind`` goes the other way for a graph run by the profiler: a copy of the constant form with
another instance's ids.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

import torch
from torch.fx import GraphModule, Node

from deepcompile import compat, ops


# Op -> (its slot overload, position of the graph id argument, position of the ds id argument or
# of the ds id list, None for ops that name no parameter).
_SLOT_FORMS = {
    ops.ALLGATHER_PARAM: (ops.ALLGATHER_PARAM_SLOT, 1, 2),
    ops.WAIT_ALLGATHER: (ops.WAIT_ALLGATHER_SLOT, 1, 2),
    ops.RELEASE_PARAM: (ops.RELEASE_PARAM_SLOT, 1, 2),
    ops.REDUCE_GRAD: (ops.REDUCE_GRAD_SLOT, 1, 2),
    ops.END_BACKWARD: (ops.END_BACKWARD_SLOT, 1, None),
    ops.PREFETCH_PARAMS_FUSED: (ops.PREFETCH_PARAMS_FUSED_SLOT, 0, 2),
}
# The slot overload of prefetch_params_fused takes the parameters first (csrc/ops.cpp says why).
_SWAP_FIRST_TWO = {ops.PREFETCH_PARAMS_FUSED_SLOT}


def to_slot_ops(gm: GraphModule, graph_id: int, slot_ids: Sequence[int], graph_input: Node) -> int:
    """Rewrite every runtime op of ``graph_id`` into its slot overload reading ``graph_input``;
    ``slot_ids`` are the graph's ds ids in slot order. Returns the number of ops rewritten."""
    slot_of: Dict[int, int] = {ds_id: slot for slot, ds_id in enumerate(slot_ids)}
    rewritten = _rewrite_ids(gm.graph, graph_id, graph_input, slot_of, to_slots=True)
    gm.graph.lint()
    gm.recompile()
    return rewritten


def rebind(gm: GraphModule, graph_id: int, new_graph_id: int, id_map: Dict[int, int]) -> GraphModule:
    """A copy of ``gm`` (constant form) whose runtime ops of ``graph_id`` name ``new_graph_id``
    and the ds ids ``id_map`` maps to."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    _rewrite_ids(graph, graph_id, new_graph_id, id_map, to_slots=False)
    return compat.lazy_graph_module(gm, graph)  # interpreted or read: code only if it is called


def _rewrite_ids(graph: torch.fx.Graph, graph_id: int, new_graph: Any, id_map: Dict[int, int], to_slots: bool) -> int:
    """Replace, in every runtime op of ``graph_id``, the graph argument by ``new_graph`` and each ds
    id by ``id_map[id]``; ``to_slots``: also switch to the slot overload (every runtime op of the
    graph must then be ``graph_id``'s)."""
    count = 0
    for node in graph.nodes:
        form = _SLOT_FORMS.get(node.target) if node.op == "call_function" else None
        if form is None:
            continue
        target, graph_pos, id_pos = form
        args = list(node.args)
        if args[graph_pos] != graph_id:
            if to_slots:
                raise RuntimeError(f"deepcompile: {node.name} belongs to graph {args[graph_pos]}, not {graph_id}")
            continue
        args[graph_pos] = new_graph
        if id_pos is not None:
            ids = args[id_pos]
            args[id_pos] = [id_map[i] for i in ids] if isinstance(ids, (list, tuple)) else id_map[ids]
        node.args = tuple(args)
        if to_slots:
            if target in _SWAP_FIRST_TWO:
                args[0], args[1] = args[1], args[0]
                node.args = tuple(args)
            node.target = target
            # Inductor constrains a custom op's inputs to the strides recorded here, position by
            # position: the record of the constant form no longer matches the arguments.
            node.meta.pop("eager_input_vals", None)
        count += 1
    return count
