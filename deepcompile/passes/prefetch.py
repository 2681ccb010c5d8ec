"""The prefetch pass (ZeRO-3): launch fused all-gathers ahead of the gathers that use them.

A plan (made by ``scheduling/planner.py``) cuts a graph's ``allgather_param`` nodes into groups
and names, for each group, the node its launch goes before. This pass only writes the plan into
the graph: one ``dc.prefetch_params_fused`` per group, carrying the group's parameters, ids and
requested dtypes. The gathers stay where they are; the runtime finds their buffers already in
flight (or ready) and only waits.
"""

from __future__ import annotations

from typing import Dict, Protocol, Sequence

import torch
from torch.fx import GraphModule, Node

from deepcompile import ops


class PlannedGather(Protocol):
    node: Node  # the allgather_param node
    ds_id: int
    dtype: torch.dtype


class PlannedGroup(Protocol):
    gathers: Sequence[PlannedGather]
    launch_before: str  # name of the node the fused launch goes before


class PrefetchPlanLike(Protocol):
    groups: Sequence[PlannedGroup]


def apply_prefetch(gm: GraphModule, graph_id: int, plan: PrefetchPlanLike) -> None:
    """Insert one ``prefetch_params_fused`` per group before its launch node, in group order."""
    by_name = {n.name: n for n in gm.graph.nodes}
    # Several groups may launch before the same node (group 0 and 1 both at the head when
    # group 0's first gather is the first node): keep their order by inserting after the last.
    inserted: Dict[str, Node] = {}
    for group in plan.groups:
        anchor = by_name[group.launch_before]
        previous = inserted.get(group.launch_before)
        ctx = gm.graph.inserting_after(previous) if previous is not None else gm.graph.inserting_before(anchor)
        with ctx:
            node = gm.graph.call_function(
                ops.PREFETCH_PARAMS_FUSED,
                (graph_id, [g.node.args[0] for g in group.gathers], [g.ds_id for g in group.gathers]),
                {"dtypes": [g.dtype for g in group.gathers]},
            )
        inserted[group.launch_before] = node
    gm.graph.lint()
