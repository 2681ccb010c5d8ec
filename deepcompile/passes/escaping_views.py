"""Views of partitioned parameters that a graph hands to eager code.

When Dynamo breaks a graph in the middle of a function (an op it cannot trace, a data-dependent
call), values computed before the break become graph outputs and the code after it runs eagerly.
If such an output is a view of a parameter (``weight.transpose(-2, -1)`` passed to a kernel that
graph-breaks), AOT autograd does not return the graph's result for it: it records the output as
an alias of the input and re-creates the view from the caller's parameter at run time. Under
ZeRO-3 the caller's parameter is the placeholder, so the eager code would compute with
placeholder data (transformers' grouped-mm expert fallback did, on torch 2.11/2.12 with
transformers 5.17: NaN from the first step).

This pass runs on the Dynamo graph, before AOT autograd: each output that shares storage with a
partitioned parameter input is replaced by a copy (``torch.clone``, which keeps the view's
strides). The copy is computed from the gathered parameter once the ZeRO-3 pass has run, owns
its storage (it outlives the graph's release of the gather, as long as the eager code or its
autograd node keeps it), and its gradient flows back through the copy into the parameter's
gradient, which the graph's backward reduces like any other.

A graph that AOT autograd cannot compile at all (a custom operator whose backward formula is
data-dependent: transformers' grouped-mm expert fallback calls ``.tolist()``) makes Dynamo run
that operator eagerly, on whatever its frame holds: the placeholder parameter itself, or a view
made of it in eager code. No graph pass can reach those; ``custom_op_parameter_inputs`` names the
parameters such an operator reads, so that the backend can have their modules run eagerly as
leaves with gathered parameters (zero/leaf_modules.py) before Dynamo traces the frame again.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Sequence

import torch
from torch.fx import GraphModule, Node

from deepcompile import compat


def copy_param_views_in_outputs(gm: GraphModule, param_indices: Iterable[int]) -> List[str]:
    """Replace outputs that alias a partitioned parameter input by copies; returns their names.

    ``param_indices`` are the graph-input positions of partitioned parameters.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = [compat.traced_value(placeholders[i]) for i in param_indices if i < len(placeholders)]
    params = [p for p in params if p is not None]
    if not params:
        return []
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    copied: List[str] = []
    copies = {}

    def replace(value):
        if not isinstance(value, Node):
            return value
        example = compat.traced_value(value)
        if example is None or not any(compat.shares_storage(example, p) for p in params):
            return value
        if value not in copies:
            with gm.graph.inserting_before(output):
                copy = gm.graph.call_function(torch.clone, (value,))
            compat.set_traced_value(copy, example.clone())  # same shape, dtype and strides
            copies[value] = copy
            copied.append(value.name)
        return copies[value]

    output.args = compat.tree_map_only(Node, replace, output.args)
    if copied:
        gm.graph.lint()
        gm.recompile()
    return copied


# Namespaces of the operators torch and deepcompile trace through; any other registered operator
# is a user's custom op, whose autograd formula AOT autograd must trace as Python code.
_TRACED_NAMESPACES = frozenset({"aten", "prims", "dc", "_c10d_functional", "c10d_functional"})


def custom_op_parameter_inputs(gm: GraphModule, example_inputs: Sequence[Any]) -> List[torch.Tensor]:
    """The graph inputs (real tensors from ``example_inputs``) whose storage a user's custom
    operator in ``gm`` reads: the parameters (or views of them) such an op would receive in
    eager code if the graph cannot be compiled and Dynamo runs the op between two graphs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [(i, compat.traced_value(n)) for i, n in enumerate(placeholders)]
    values = [(i, v) for i, v in values if v is not None and i < len(example_inputs)]
    found: Dict[int, torch.Tensor] = {}
    for node in gm.graph.nodes:
        namespace = compat.operator_namespace(node.target) if node.op == "call_function" else None
        if namespace is None or namespace in _TRACED_NAMESPACES:
            continue
        for arg in compat.tree_leaves((node.args, node.kwargs)):
            value = compat.traced_value(arg) if isinstance(arg, Node) else None
            if value is None:
                continue
            for i, input_value in values:
                if i not in found and compat.shares_storage(value, input_value):
                    found[i] = example_inputs[i]
    return [found[i] for i in sorted(found)]
