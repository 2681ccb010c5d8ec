"""Turning profiles into decisions: the prefetch plan of a graph and the persistent set.

Both planners are pure functions of the graph, the (rank-agreed) profiles, the (rank-agreed)
communication model and the budget, so every rank computes the same plan: the order and grouping
of collectives must match on all ranks, or they hang.

Prefetch (per graph). The graph's ``allgather_param`` nodes, in order, are cut into fused groups.
With a communication model, a gather joins the open group while fusing is nearly free: the fused
gather must take less than ``FUSE_SLACK`` times the longer of the two alone plus what a separate
launch would cost (``GROUP_LAUNCH_MS``: latency-bound sizes, and sizes a fast link moves in less
time than the runtime needs to launch them), and the group stays within ``max_group_numel``
elements. Without a model, groups are filled up to
``max_group_numel``. Each group ``k >= 1`` is launched at the start of group ``k - 1`` (group 0 at
the head of the graph), so it travels while the previous group computes, but only if the memory
profiled over that window plus the group's bytes stays within the budget; otherwise it is
gathered at its use, as the plain ZeRO-3 pass does. Without a profile every group goes ahead (the
static plan). With a live-parameter limit (DeepSpeed's ``stage3_max_live_parameters``), a group
goes ahead only if its elements plus those kept gathered by selective unsharding stay within the
limit: what the op in flight needs is not counted, what is held beyond it is. The requested dtype of every gather is kept. ``passes/prefetch.py`` writes the plan
into the graph.

Selective unsharding (per engine). Candidates are the partitioned parameters the profiled graphs
gather. Keeping one gathered saves ``(gathers per optimizer step - 1)`` all-gathers of its size
(one re-gather after each optimizer step remains) and costs its bytes for the whole step. The
planner ranks candidates by time saved per byte and takes them greedily while the predicted peak
(profiled peak + prefetch extra + persistent bytes) stays within the budget, skipping those that
do not fit. DeepSpeed's two limits, in elements, constrain the choice as well: the kept elements plus
the most any prefetch holds ahead stay within ``stage3_max_live_parameters``, and a parameter is a
candidate only if its reuse distance (the elements the other gathers of a step bring in between two
of its uses, :func:`reuse_distances`) is at most ``stage3_max_reuse_distance``: DeepSpeed keeps a
released parameter only when it is used again that soon.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
from torch.fx import GraphModule, Node

from deepcompile import ops
from deepcompile.profiling.comm_model import CommModel
from deepcompile.profiling.graph_profiler import GraphProfile


# Fuse two gathers while the fused one costs less than this factor times the longer of the two,
# plus GROUP_LAUNCH_MS.
FUSE_SLACK = 1.2
# What one more prefetch group costs beyond the bytes it moves: the runtime's host work per
# launch (op dispatch, opening and closing the communicator group, the events its waits use) and
# the collective's own launch. The measured all-gather curve holds only the second. Without this
# term a fast link made every gather of a 1B model "bandwidth-bound": 163 groups a step through
# Trainer against 41 in a run whose measured latency floor happened to be higher (2 x H200,
# 2026-11-28), in a step whose forward is host-bound. An estimate from those traces
# (``prefetch_params_fused`` took 125 us of host time per call, most of it per parameter).
GROUP_LAUNCH_MS = 0.05


@dataclasses.dataclass
class Gather:
    node: Node
    ds_id: int
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def graph_gathers(gm: GraphModule) -> List[Gather]:
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is ops.ALLGATHER_PARAM:
            val = node.args[0].meta.get("val")
            numel = int(val.numel()) if isinstance(val, torch.Tensor) else 0
            dtype = node.kwargs.get("dtype") or (val.dtype if isinstance(val, torch.Tensor) else torch.float32)
            out.append(Gather(node, int(node.args[2]), numel, dtype))
    return out


def graph_signature(phase: str, gm: GraphModule) -> Tuple:
    """Identifies "the same graph" across recompiles: phase, gathered ids in order, node count."""
    return (phase, tuple(g.ds_id for g in graph_gathers(gm)), len(gm.graph.nodes))


@dataclasses.dataclass
class PrefetchGroup:
    gathers: List[Gather]
    launch_before: str  # name of the node the fused launch is inserted before
    ahead: bool  # launched before its first use (False: at its use)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.gathers)

    def to_dict(self, names: Dict[int, str]) -> Dict:
        return {
            "ds_ids": [g.ds_id for g in self.gathers],
            "params": [names.get(g.ds_id, str(g.ds_id)) for g in self.gathers],
            "bytes": self.nbytes,
            "launch_before": self.launch_before,
            "ahead": self.ahead,
        }


@dataclasses.dataclass
class PrefetchPlan:
    groups: List[PrefetchGroup]
    predicted_peak_bytes: Optional[int]  # None without a profile
    guided: bool  # planned from a profile (False: static fallback)

    resident: frozenset = frozenset()
    kept_numel: int = 0  # elements kept gathered by selective unsharding, held throughout
    max_live_numel: Optional[int] = None  # stage3_max_live_parameters (None: no limit)

    @property
    def max_ahead_numel(self) -> int:
        return max((_ahead_numel(g.gathers, self.resident) for g in self.groups if g.ahead), default=0)

    @property
    def peak_live_numel(self) -> int:
        """The most elements held beyond the op in flight: the kept ones plus the largest group
        held ahead of its use (one at a time: group k is launched when group k - 1 starts)."""
        return self.kept_numel + self.max_ahead_numel

    @property
    def max_ahead_bytes(self) -> int:
        return max((sum(x.nbytes for x in g.gathers if x.ds_id not in self.resident)
                    for g in self.groups if g.ahead), default=0)


def _ahead_numel(gathers: Iterable[Gather], resident: Iterable[int]) -> int:
    """Elements a group newly holds when launched ahead: resident parameters hold theirs anyway."""
    return sum(g.numel for g in gathers if g.ds_id not in resident)


def _fuse(gathers: Sequence[Gather], max_group_numel: int, comm: Optional[CommModel]) -> List[List[Gather]]:
    groups: List[List[Gather]] = []
    numel = nbytes = 0
    for g in gathers:
        fits = bool(groups) and numel + g.numel <= max(max_group_numel, 1)
        if fits and comm is not None:
            fused = comm.predict_ms(nbytes + g.nbytes)
            fits = fused <= FUSE_SLACK * max(comm.predict_ms(nbytes), comm.predict_ms(g.nbytes)) + GROUP_LAUNCH_MS
        if fits:
            groups[-1].append(g)
            numel += g.numel
            nbytes += g.nbytes
        else:
            groups.append([g])
            numel, nbytes = g.numel, g.nbytes
    return groups


def _node_peaks(gm: GraphModule, profile: GraphProfile) -> Dict[str, int]:
    """Profiled peak per node of ``gm``; a node the profile lacks inherits its predecessor's."""
    by_name = profile.by_name()
    peaks, last = {}, 0
    for node in gm.graph.nodes:
        rec = by_name.get(node.name)
        if rec is not None:
            last = rec.peak_bytes
        peaks[node.name] = last
    return peaks


def plan_prefetch(gm: GraphModule, max_group_numel: int, resident: Iterable[int] = (),
                  profile: Optional[GraphProfile] = None, comm: Optional[CommModel] = None,
                  budget_bytes: Optional[int] = None, max_live_numel: Optional[int] = None,
                  kept_numel: int = 0) -> PrefetchPlan:
    """``resident``: persistent parameters. They stay in the groups: after every optimizer step
    they are stale and refilled by their first gather, which must be prefetched like any other
    (the runtime skips them when they are still valid). Their buffers are kept, so launching
    them early costs no memory and they count 0 bytes against the budget.

    ``max_live_numel``: DeepSpeed's ``stage3_max_live_parameters`` (None: no limit); a group goes
    ahead only if ``kept_numel`` (the elements selective unsharding keeps gathered) plus its own
    non-resident elements stay within it, with or without a profile."""
    kept = set(resident)
    limits = dict(kept_numel=kept_numel, max_live_numel=max_live_numel)
    gathers = graph_gathers(gm)
    guided = profile is not None and profile.complete
    groups = _fuse(gathers, max_group_numel, comm if guided else None)
    if not groups:
        return PrefetchPlan([], profile.peak_bytes if guided else None, guided, frozenset(kept), **limits)
    order = {node.name: i for i, node in enumerate(gm.graph.nodes)}
    nodes = list(gm.graph.nodes)
    head = next(n for n in nodes if n.op != "placeholder")
    peaks = _node_peaks(gm, profile) if guided else {}
    predicted = profile.peak_bytes if guided else None
    planned: List[PrefetchGroup] = []
    for k, group in enumerate(groups):
        use = group[0].node
        anchor = head if k == 0 else groups[k - 1][0].node
        ahead = max_live_numel is None or kept_numel + _ahead_numel(group, kept) <= max_live_numel
        if guided and ahead:
            window = nodes[order[anchor.name]: order[use.name] + 1]
            window_peak = max((peaks[n.name] for n in window), default=0)
            extra = sum(g.nbytes for g in group if g.ds_id not in kept)
            ahead = budget_bytes is None or window_peak + extra <= budget_bytes
            if ahead:
                predicted = max(predicted, window_peak + extra)
        planned.append(PrefetchGroup(group, (anchor if ahead else use).name, ahead))
    return PrefetchPlan(planned, predicted, guided, frozenset(kept), **limits)


@dataclasses.dataclass
class PersistentChoice:
    ds_id: int
    nbytes: int
    saved_ms: float  # all-gather time saved per optimizer step
    numel: int = 0
    reuse_numel: Optional[int] = None  # its reuse distance (reuse_distances)


@dataclasses.dataclass
class PersistentPlan:
    chosen: List[PersistentChoice]
    base_peak_bytes: int  # profiled peak (+ prefetch extra) before adding persistent parameters
    budget_bytes: Optional[int]  # None: no limit
    skipped_reason: str = ""
    prefetch_extra_numel: int = 0  # the most elements any prefetch holds ahead of its use
    max_live_numel: Optional[int] = None  # stage3_max_live_parameters (None: no limit)
    max_reuse_numel: Optional[int] = None  # stage3_max_reuse_distance (None: no limit)
    beyond_reuse: int = 0  # candidates left out for their reuse distance

    @property
    def kept_numel(self) -> int:
        return sum(c.numel for c in self.chosen)

    @property
    def peak_live_numel(self) -> int:
        """The most elements the plan holds beyond the op in flight: kept plus prefetched ahead."""
        return self.kept_numel + self.prefetch_extra_numel

    @property
    def ids(self) -> List[int]:
        return [c.ds_id for c in self.chosen]

    @property
    def predicted_peak_bytes(self) -> int:
        return self.base_peak_bytes + sum(c.nbytes for c in self.chosen)


def reuse_distances(gathers_per_graph: Sequence[Sequence[Gather]], micro_steps_per_step: int,
                    skip: Iterable[int] = ()) -> Dict[int, int]:
    """Per parameter gathered more than once per optimizer step, its reuse distance: the most
    elements the other gathers bring in between two consecutive uses of it, the graphs taken in the
    order given (the order they run in a micro-step). With several micro-steps per optimizer step,
    the gap from its last use in one micro-step to its first in the next counts too; across an
    optimizer step it is re-gathered anyway. ``skip``: parameters that are never released (they
    neither have a distance nor add to others')."""
    skip = set(skip)
    seq = [g for gathers in gathers_per_graph for g in gathers if g.ds_id not in skip]
    before = [0]  # before[i]: elements gathered by seq[:i]
    for g in seq:
        before.append(before[-1] + g.numel)
    uses: Dict[int, List[int]] = {}
    for i, g in enumerate(seq):
        uses.setdefault(g.ds_id, []).append(i)
    out = {}
    for ds_id, at in uses.items():
        gaps = [before[b] - before[a + 1] for a, b in zip(at, at[1:])]
        if micro_steps_per_step > 1:
            gaps.append(before[-1] - before[at[-1] + 1] + before[at[0]])
        if gaps:
            out[ds_id] = max(gaps)
    return out


def plan_persistent(gathers_per_graph: Sequence[Sequence[Gather]], profiles: Sequence[GraphProfile],
                    comm: CommModel, budget_bytes: Optional[int], micro_steps_per_step: int,
                    prefetch_extra_bytes: int = 0, already: Iterable[int] = (),
                    max_live_numel: Optional[int] = None, max_reuse_numel: Optional[int] = None,
                    prefetch_extra_numel: int = 0) -> PersistentPlan:
    """Choose the parameters to keep gathered (see the module docstring). ``gathers_per_graph``
    in the order the graphs run; ``max_live_numel`` / ``max_reuse_numel``: DeepSpeed's
    ``stage3_max_live_parameters`` / ``stage3_max_reuse_distance`` (None: no limit);
    ``prefetch_extra_numel``: the most elements the prefetch plans hold ahead of a use."""
    base = max((p.peak_bytes for p in profiles), default=0) + prefetch_extra_bytes
    limits = dict(prefetch_extra_numel=prefetch_extra_numel, max_live_numel=max_live_numel,
                  max_reuse_numel=max_reuse_numel)
    if not profiles or any(not p.complete for p in profiles):
        return PersistentPlan([], base, budget_bytes, "a profile is missing or incomplete", **limits)
    skip: Set[int] = set(already)
    count: Dict[int, int] = {}
    size: Dict[int, int] = {}
    numel: Dict[int, int] = {}
    for gathers in gathers_per_graph:
        for g in gathers:
            if g.ds_id in skip:
                continue
            count[g.ds_id] = count.get(g.ds_id, 0) + 1
            size[g.ds_id] = max(size.get(g.ds_id, 0), g.nbytes)
            numel[g.ds_id] = max(numel.get(g.ds_id, 0), g.numel)
    distance = reuse_distances(gathers_per_graph, micro_steps_per_step, skip)
    candidates, beyond_reuse = [], 0
    for ds_id, n in count.items():
        saved = (n * micro_steps_per_step - 1) * comm.predict_ms(size[ds_id])
        if saved > 0 and size[ds_id] > 0:
            reuse = distance.get(ds_id)
            if max_reuse_numel is not None and (reuse is None or reuse > max_reuse_numel):
                beyond_reuse += 1
                continue
            candidates.append(PersistentChoice(ds_id, size[ds_id], saved, numel[ds_id], reuse))
    # Most time saved per byte first; ties broken by id so every rank orders alike.
    candidates.sort(key=lambda c: (-c.saved_ms / c.nbytes, c.ds_id))
    chosen, used, live = [], base, prefetch_extra_numel
    for c in candidates:
        fits_budget = budget_bytes is None or used + c.nbytes <= budget_bytes
        fits_live = max_live_numel is None or live + c.numel <= max_live_numel
        if fits_budget and fits_live:
            chosen.append(c)
            used += c.nbytes
            live += c.numel
    if chosen:
        reason = ""
    elif candidates:
        reason = "nothing fits in the budget" + (" or stage3_max_live_parameters" if max_live_numel is not None else "")
    elif beyond_reuse:
        reason = "every candidate's reuse distance is above stage3_max_reuse_distance"
    else:
        reason = "no candidates"
    return PersistentPlan(chosen, base, budget_bytes, reason, beyond_reuse=beyond_reuse, **limits)
