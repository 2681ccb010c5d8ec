"""Prefetch across graphs: while one layer runs, the next layer's first parameters are gathered.

Within a graph the prefetch plan launches gathers ahead of their use. A layer compiled on its own
(regional compilation, compiler/regions.py) is a graph of its own, so its first prefetch group
could only be launched at its own head, with nothing to hide it behind. FSDP2 gathers the next
layer while the current one computes; this does the same for the instances of shared graphs:

* the order in which instances run, per phase, is recorded during the profiled micro-step;
* at the plan switch every consecutive pair (a, b) where b is an instance of a graph that several
  instances share, and a is always followed by b, becomes a link; the ranks check that they
  learned the same links (a prefetch is a collective), and drop them all otherwise;
* from then on, when instance a starts, the first prefetch group of b's graph is launched for b's
  parameters. The runtime skips parameters already gathered, and b's own prefetch at its head
  then finds its buffers in flight or ready.

A link that turns out wrong (b does not follow a after all) costs memory, not correctness: the
gathered parameters stay until their next use releases them.

Memory: b's first group is held from a's start, on top of a's own peak. A link is used only if
the predicted peak of a's plan plus that group stays within the memory budget (the driver's, the
one the prefetch and persistence plans keep to) and, with ``stage3_max_live_parameters``, if the
elements a's plan holds beyond its op in flight plus that group's stay within that limit. Both numbers come from profiles and plans that
every rank holds alike (the profiler agrees on MAX values), so every rank keeps or drops the same
links: a prefetch is a collective.
"""

from __future__ import annotations

import logging
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from deepcompile import ops

log = logging.getLogger(__name__)

PHASES = ("forward", "backward")


class HeadGroup:
    """The first prefetch group of one graph half: the first instance's ds ids and their dtypes."""

    __slots__ = ("ds_ids", "dtypes", "nbytes", "numel")

    def __init__(self, ds_ids: Sequence[int], dtypes: Sequence[torch.dtype], nbytes: int = 0, numel: int = 0):
        self.ds_ids = list(ds_ids)
        self.dtypes = list(dtypes)
        self.nbytes = nbytes  # gathered bytes
        self.numel = numel  # gathered elements


class InstanceChain:
    def __init__(self):
        self._recording = False
        self._calls: Dict[str, List[Any]] = {phase: [] for phase in PHASES}
        self.links: Dict[Tuple[str, int], Any] = {}  # (phase, graph id) -> the instance that follows
        self.heads: Dict[Tuple[str, int], HeadGroup] = {}  # (phase, template graph id) -> its first group
        # (phase, template graph id) -> the predicted peak of its prefetch plan (None: unknown).
        self.peaks: Dict[Tuple[str, int], Optional[int]] = {}
        self.budget_bytes: Optional[int] = None  # None: no budget to keep to
        # (phase, template graph id) -> the most elements its plan holds beyond the op in flight.
        self.live: Dict[Tuple[str, int], int] = {}
        self.max_live_numel: Optional[int] = None  # stage3_max_live_parameters (None: no limit)
        self._fits: Dict[Tuple[str, int], bool] = {}  # per link, decided at its first use
        self.launched = 0  # prefetches launched across graphs (tests, reports)
        self.held_back = 0  # launches skipped because the group would not fit the budget

    # ---- learning the order ------------------------------------------------------------------

    def start_recording(self) -> None:
        self._recording = True
        self._calls = {phase: [] for phase in PHASES}

    def stop_recording(self) -> None:
        self._recording = False

    def note(self, phase: str, instance: Any) -> None:
        """``instance`` (a ``compiler.graph_instances.GraphInstance``) runs a half of ``phase``."""
        if self._recording:
            self._calls[phase].append(instance)

    def build(self, group: Optional[dist.ProcessGroup], device: torch.device) -> None:
        """Links from the recorded order; collective: every rank must call it at the same step."""
        links: Dict[Tuple[str, int], Any] = {}
        ambiguous = set()
        for phase, calls in self._calls.items():
            per_template: Dict[int, set] = {}
            for instance in calls:
                per_template.setdefault(instance.template_graph_id, set()).add(instance.graph_id)
            for a, b in zip(calls, calls[1:]):
                if a.graph_id == b.graph_id or len(per_template[b.template_graph_id]) < 2:
                    continue
                key = (phase, a.graph_id)
                if key in links and links[key].graph_id != b.graph_id:
                    ambiguous.add(key)
                links[key] = b
        for key in ambiguous:
            del links[key]
        if not _same_on_every_rank(links, group, device):
            log.warning("deepcompile: the ranks ran their graphs in different orders; no prefetch across graphs")
            links = {}
        self.links = links
        self._fits = {}
        self._calls = {phase: [] for phase in PHASES}

    def clear(self) -> None:
        self.links = {}
        self._fits = {}

    # ---- what to prefetch --------------------------------------------------------------------

    def set_head(self, phase: str, template_graph_id: int, plan: Any) -> None:
        """Remember the first group of the prefetch plan ``plan`` (or None) of a half, and the
        plan's predicted peak."""
        self._fits = {}
        self.peaks[(phase, template_graph_id)] = plan.predicted_peak_bytes if plan is not None else None
        self.live[(phase, template_graph_id)] = plan.peak_live_numel if plan is not None else 0
        if plan is None or not plan.groups:
            self.heads.pop((phase, template_graph_id), None)
            return
        group = plan.groups[0]
        self.heads[(phase, template_graph_id)] = HeadGroup([g.ds_id for g in group.gathers],
                                                           [g.dtype for g in group.gathers], group.nbytes,
                                                           sum(g.numel for g in group.gathers
                                                               if g.ds_id not in plan.resident))

    def launch_after(self, phase: str, graph_id: int, template_graph_id: int) -> None:
        """Instance ``graph_id`` (of the graph compiled for ``template_graph_id``) starts a half of
        ``phase``: launch its successor's first group."""
        following = self.links.get((phase, graph_id))
        if following is None:
            return
        head = self.heads.get((phase, following.template_graph_id))
        if head is None:
            return
        fits = self._fits.get((phase, graph_id))
        if fits is None:
            fits = self._fits[(phase, graph_id)] = self._fits_budget(phase, template_graph_id, head)
        if not fits:
            self.held_back += 1
            return
        _prefetch(following.graph_id, following.ds_ids(head.ds_ids), head.dtypes)
        self.launched += 1

    def report(self) -> Dict[str, Any]:
        """For ``engine.schedule_report()``: the links and what they launched or held back."""
        return {"links": len(self.links), "launched": self.launched, "held_back_for_memory": self.held_back,
                "budget_bytes": self.budget_bytes}

    def _fits_budget(self, phase: str, template_graph_id: int, head: HeadGroup) -> bool:
        """Whether ``head``, held through the run of an instance of ``template_graph_id``'s graph,
        stays within the budget above that graph's predicted peak (unknown peak: it does not,
        unless there is no budget), and within ``max_live_numel`` above the elements that graph's
        plan holds."""
        if self.max_live_numel is not None \
                and self.live.get((phase, template_graph_id), 0) + head.numel > self.max_live_numel:
            return False
        if self.budget_bytes is None:
            return True
        peak = self.peaks.get((phase, template_graph_id))
        return peak is not None and peak + head.nbytes <= self.budget_bytes


def _prefetch(graph_id: int, ds_ids: List[int], dtypes: List[torch.dtype]) -> None:
    ops.prefetch_params_fused(graph_id, [], ds_ids, dtypes)


def _same_on_every_rank(links: Dict[Tuple[str, int], Any], group: Optional[dist.ProcessGroup],
                        device: torch.device) -> bool:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return True
    summary = repr(sorted((phase, a, b.graph_id) for (phase, a), b in links.items())).encode()
    digest = zlib.crc32(summary)
    t = torch.tensor([digest, -digest], dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t[0]) == digest and -int(t[1]) == digest
