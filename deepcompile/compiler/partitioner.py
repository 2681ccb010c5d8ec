"""Joint-graph partitioning that never saves a gathered parameter for backward.

The ZeRO-3 gathers are inserted after partitioning, so to the partitioner a parameter is just an
input. Left alone it may save views or casts of a parameter (e.g. ``t(weight)``) for backward;
after the pass those would be views of the *gathered* buffer, pinning it until backward. Marking
every view/cast chain that starts at a parameter as must-recompute makes the partitioner save
the parameter input itself (free: it is an input) and recompute the views in backward, where the
pass re-gathers the parameter.
"""

from __future__ import annotations

from typing import Callable, Set

import torch
from torch.fx import GraphModule
from torch.utils.checkpoint import CheckpointPolicy

from deepcompile.passes.graph_utils import is_alias_op, is_cast_op


def mark_parameter_views_recompute(joint: GraphModule, param_input_indices: Set[int]) -> int:
    primals = [n for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("primals_")]
    marked = {primals[i] for i in param_input_indices if i < len(primals)}
    count = 0
    for node in joint.graph.nodes:
        node.meta.setdefault("ac_graph_id", 1)
        if node.op != "call_function" or not (is_alias_op(node) or is_cast_op(node)):
            continue
        if node.args and node.args[0] in marked:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            marked.add(node)
            count += 1
    return count


def make_partition_fn(base: Callable, param_input_indices: Set[int]) -> Callable:
    def partition(joint_module: GraphModule, joint_inputs, **kwargs):
        mark_parameter_views_recompute(joint_module, param_input_indices)
        return base(joint_module, joint_inputs, **kwargs)

    return partition
