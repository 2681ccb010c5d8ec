"""One profile for a graph that several instances run (shared layer graphs, compiler/graph_instances.py).

The instances of a shared graph run one compiled code, so they run one prefetch plan: a plan per
instance would need a compile per distinct plan, which is what sharing avoids. What differs
between instances is what the profile measured: the memory around each node (a later layer runs
with more activations alive) and which of their parameters selective unsharding keeps gathered
(the runtime skips those while valid, so the shared groups are right for each instance, only
smaller in real traffic). The plan is made from the instances' profiles merged: per node, the
largest peak any instance was profiled at. A group the plan launches ahead then fits the budget
for every instance, not only for the first one profiled.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Sequence

from deepcompile.profiling.graph_profiler import GraphProfile


def merged_profile(first: GraphProfile, others: Sequence[GraphProfile]) -> GraphProfile:
    """``first``'s profile (its nodes, names and times), each node's peak the largest of
    ``first``'s and ``others``' at the node of that name (the instances' graphs are copies of one
    graph, so their nodes carry the same names). Incomplete profiles of others are left out."""
    peaks: Dict[str, int] = {}
    for profile in others:
        if not profile.complete:
            continue
        for node in profile.nodes:
            peaks[node.name] = max(peaks.get(node.name, 0), node.peak_bytes)
    if not peaks:
        return first
    nodes = [dataclasses.replace(n, peak_bytes=max(n.peak_bytes, peaks.get(n.name, 0))) for n in first.nodes]
    return GraphProfile(first.graph_id, first.phase, nodes, first.complete, first.error)
