"""Joint-graph partitioning: Inductor's joint-graph passes, and (ZeRO-3) never saving a gathered
parameter for backward.

With Inductor as the inner compiler, the partition function first runs the joint-graph passes
that Inductor's own partition function runs (compat.inductor_joint_graph_passes): skipping them
changes what the backward computes and keeps, e.g. a materialised fp32 gradient of the logits.

The ZeRO-3 gathers are inserted after partitioning, so to the partitioner a parameter is just an
input. Left alone it may save views or casts of a parameter (e.g. ``t(weight)``) for backward;
after the pass those would be views of the *gathered* buffer, pinning it until backward. Marking
every view/cast chain that starts at a parameter as must-recompute makes the partitioner save
the parameter input itself (free: it is an input) and recompute the views in backward, where the
pass re-gathers the parameter.

The graph's instance input (compiler/graph_instances.py: which parameter set a shared graph runs
for) is read by the runtime ops of the backward too, so it is made a saved value after the
partition: nothing in the joint graph reads it, since the ops are inserted into the halves.
"""

from __future__ import annotations

from typing import Callable, Optional, Set

from torch.fx import GraphModule

from deepcompile import compat
from deepcompile.passes.graph_utils import is_alias_op, is_cast_op


def mark_parameter_views_recompute(joint: GraphModule, param_input_indices: Set[int]) -> int:
    """Mark every view/cast chain that starts at a parameter input as must-recompute; returns
    how many nodes were marked."""
    primals = compat.joint_primal_inputs(joint)
    chain = {primals[i] for i in param_input_indices if i < len(primals)}
    marked = []
    for node in joint.graph.nodes:
        if node.op != "call_function" or not (is_alias_op(node) or is_cast_op(node)):
            continue
        if node.args and node.args[0] in chain:
            chain.add(node)
            marked.append(node)
    compat.mark_must_recompute(joint, marked)
    return len(marked)


GRAPH_INPUT_NAME = "dc_graph"  # the backward's placeholder for the saved instance input


def make_partition_fn(param_input_indices: Optional[Set[int]], joint_passes: bool,
                      on_forward_outputs: Optional[Callable[[Optional[int]], None]] = None,
                      graph_input_index: Optional[int] = None) -> Callable:
    """aot_autograd's min-cut partitioner after Inductor's joint-graph passes (``joint_passes``)
    and, for ZeRO-3 (``param_input_indices`` not None), the recompute marks on parameter views.
    The marks come after the passes: a pattern rewrite could replace a marked node by an unmarked
    one. ``on_forward_outputs`` hears how many forward outputs the caller sees (the rest are
    saved for backward: passes/saved_values.py). ``graph_input_index``: the forward input that
    names the graph instance, saved for the backward as placeholder ``GRAPH_INPUT_NAME``."""

    def partition(joint_module: GraphModule, joint_inputs, **kwargs):
        num_fwd_outputs = compat.partition_forward_output_count(kwargs)
        if on_forward_outputs is not None:
            on_forward_outputs(num_fwd_outputs)
        if joint_passes:
            joint_module = compat.inductor_joint_graph_passes(joint_module, joint_inputs)
        if param_input_indices is not None:
            mark_parameter_views_recompute(joint_module, param_input_indices)
        forward, backward = compat.min_cut_partition(joint_module, joint_inputs, **kwargs)
        if graph_input_index is not None:
            if num_fwd_outputs is None:
                raise RuntimeError("deepcompile: aot_autograd did not say how many forward outputs the caller sees; "
                                   "the graph instance input cannot be saved for the backward")
            compat.save_forward_input_for_backward(forward, backward, graph_input_index, num_fwd_outputs,
                                                   GRAPH_INPUT_NAME)
        return forward, backward

    return partition
