"""Prefetch across graphs: while one unit of the step runs, the next units' first gathers fly.

Within a graph the prefetch plan launches each group of gathers one group ahead of its use. A
layer compiled on its own (regional compilation, compiler/regions.py) is a graph of its own, and
the modules outside the layers (embedding, final norm, head) run eagerly, their parameters
gathered by the eager hooks at their start: without help, every layer's first group and every
eager module's parameters would be gathered with nothing to hide them behind, where the
whole-model graph launches them one group ahead like any other. FSDP2 gathers the next layer
while the current one computes; this does the same for every *unit* of a step:

* a unit is a run of a graph half (a ``compiler.graph_instances.GraphInstance``: the graph id of
  one parameter set) or an :class:`EagerUnit`: the start of the step, or an eager module that
  holds partitioned parameters (``compiler/eager_units.py`` reports them; in the backward, the
  moment the gradient of its output arrives);
* the order in which units run, per phase, is recorded during the profiled micro-step;
* at the plan switch every consecutive pair (a, b) where a is always followed by b becomes a
  link; the ranks check that they learned the same links (a prefetch is a collective), and drop
  them all otherwise;
* from then on, when a starts, b's first gathers are launched: a graph's first prefetch group
  (for b's parameters), an eager module's parameters (forward; in the backward autograd holds the
  copies its forward gathered, so it gathers nothing). An eager unit's gathers all happen at its
  start, with no compute of its own before them, so the chain walks on past it: the next units
  up to and including the next graph are launched together. The runtime skips parameters
  already gathered, and b's own gathers at its head then find their buffers in flight or ready.

This is at least as far ahead as the whole-model graph, whose plan launches every group at the
start of the group before it: the next layer's first group is launched at the start of the
current layer's last group there, at the start of the current layer here.

A link that turns out wrong costs memory, not correctness: the gathered parameters stay until
their next use releases them.

Memory: what a link launches is held from a's start, on top of a's own peak. It is launched only
if a's predicted peak plus it stays within the memory budget (the driver's, the one the prefetch
and persistence plans keep to) and, with ``stage3_max_live_parameters``, if the elements a's plan
holds beyond its op in flight plus it stay within that limit (a walk stops at the first unit that
would not fit). a's peak is *its own*: the profile of that instance (instances of one graph
differ: later layers run with more activations alive), plus what its plan prefetches ahead; an
eager unit has no profile, and counts at the largest profiled peak of its phase (the eager
modules outside the layers hold no more than the layer graphs around them). These numbers come
from profiles and plans that every rank holds alike (the profiler agrees on MAX values), so every
rank keeps or drops the same links.

Counting (``counting`` on, for tests and diagnostics; off by default, it reads the runtime's
state of each unit's first parameters at every unit start): at each unit's start, how many of its
first gathers were already in flight or valid (*warm*: launched ahead) and how many were not
(*cold*: gathered at the unit's head, or by the eager hook at use).
"""

from __future__ import annotations

import logging
import zlib
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from deepcompile import ops, runtime

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


class EagerUnit:
    """A unit of the step that is no compiled graph: an eager module's parameters, gathered by the
    eager hooks at its start (``ds_ids`` with their gathered ``numels``), or no parameters at all
    (the start of the step, a module whose backward gathers nothing). ``graph_id`` is a negative
    key, unique per unit and alike on every rank, that never collides with a graph id;
    ``prefetch_graph_id``: the executor whose gathers the eager hooks use."""

    __slots__ = ("graph_id", "template_graph_id", "name", "ids", "numels", "prefetch_graph_id", "_dtypes")

    def __init__(self, key: int, name: str, ds_ids: Sequence[int] = (), numels: Sequence[int] = (),
                 prefetch_graph_id: int = 0, dtypes: Optional[Sequence[torch.dtype]] = None):
        if key >= 0:
            raise ValueError(f"an eager unit's key is negative, got {key}")
        self.graph_id = self.template_graph_id = key
        self.name = name
        self.ids = list(ds_ids)
        self.numels = list(numels)
        self.prefetch_graph_id = prefetch_graph_id
        self._dtypes = None if dtypes is None else list(dtypes)  # None: the runtime's, at the first launch

    def head(self, phase: str) -> "Launch":
        if phase != "forward" or not self.ids:
            return Launch(self.prefetch_graph_id, [], [], 0, 0)
        if self._dtypes is None:  # registered by then: the engine exists before any unit runs
            self._dtypes = [runtime.gather_dtype(i) for i in self.ids]
        nbytes = sum(n * d.itemsize for n, d in zip(self.numels, self._dtypes))
        return Launch(self.prefetch_graph_id, self.ids, self._dtypes, nbytes, sum(self.numels))


class Launch:
    """What one unit gathers first: launched ahead by its predecessor."""

    __slots__ = ("graph_id", "ds_ids", "dtypes", "nbytes", "numel")

    def __init__(self, graph_id: int, ds_ids: List[int], dtypes: List[torch.dtype], nbytes: int, numel: int):
        self.graph_id, self.ds_ids, self.dtypes, self.nbytes, self.numel = graph_id, ds_ids, dtypes, nbytes, numel


class InstanceChain:
    def __init__(self):
        self._recording = False
        self._calls: Dict[str, List[Any]] = {phase: [] for phase in PHASES}
        self.links: Dict[Tuple[str, int], Any] = {}  # (phase, unit key) -> the unit that follows
        # (phase, template graph id) -> the graph ids of its instances that ran (the last recording).
        self.instances_of: Dict[Tuple[str, int], Set[int]] = {}
        self.heads: Dict[Tuple[str, int], HeadGroup] = {}  # (phase, template graph id) -> its first group
        # (phase, template graph id) -> the predicted peak of its prefetch plan (None: unknown).
        self.peaks: Dict[Tuple[str, int], Optional[int]] = {}
        # (phase, graph id) -> the profiled peak of that graph instance (set_profiled_peaks).
        self.profiled: Dict[Tuple[str, int], int] = {}
        self.budget_bytes: Optional[int] = None  # None: no budget to keep to
        # (phase, template graph id) -> the most elements its plan holds beyond the op in flight.
        self.live: Dict[Tuple[str, int], int] = {}
        self.max_live_numel: Optional[int] = None  # stage3_max_live_parameters (None: no limit)
        self.deep = True  # walk on past eager units (tests switch it off to see what it buys)
        self._resolved: Dict[Tuple[str, int], Tuple[List[Launch], bool]] = {}  # per link, at its first use
        self.launched = 0  # prefetches launched across graphs (tests, reports)
        self.held_back = 0  # launches skipped because the group would not fit the budget
        self.counting = False
        self.cold_units = 0  # unit starts with some first gather not launched ahead
        self.cold_params = 0  # first gathers of a unit not launched ahead
        self.warm_params = 0  # first gathers of a unit found in flight or valid at its start
        self.eager_on_demand = 0  # of the cold ones, those the eager hooks gather at use

    # ---- learning the order ------------------------------------------------------------------

    def start_recording(self) -> None:
        self._recording = True
        self._calls = {phase: [] for phase in PHASES}

    def stop_recording(self) -> None:
        self._recording = False

    def note(self, phase: str, unit: Any) -> None:
        """``unit`` (a ``GraphInstance`` or an :class:`EagerUnit`) runs a half of ``phase``."""
        if self._recording:
            self._calls[phase].append(unit)

    def build(self, group: Optional[dist.ProcessGroup], device: torch.device) -> None:
        """Links from the recorded order; collective: every rank must call it at the same step."""
        links: Dict[Tuple[str, int], Any] = {}
        ambiguous = set()
        for phase, calls in self._calls.items():
            for a, b in zip(calls, calls[1:]):
                if a.graph_id == b.graph_id:
                    continue
                key = (phase, a.graph_id)
                if key in links and links[key].graph_id != b.graph_id:
                    ambiguous.add(key)
                links[key] = b
        for key in ambiguous:
            del links[key]
        self.instances_of = {}
        for phase, calls in self._calls.items():
            for unit in calls:
                if not isinstance(unit, EagerUnit):
                    self.instances_of.setdefault((phase, unit.template_graph_id), set()).add(unit.graph_id)
        if not _same_on_every_rank(links, group, device):
            log.warning("deepcompile: the ranks ran their graphs in different orders; no prefetch across graphs")
            links = {}
        self.links = links
        self._resolved = {}
        self._calls = {phase: [] for phase in PHASES}

    def clear(self) -> None:
        self.links = {}
        self._resolved = {}

    # ---- what to prefetch --------------------------------------------------------------------

    def set_head(self, phase: str, template_graph_id: int, plan: Any) -> None:
        """Remember the first group of the prefetch plan ``plan`` (or None) of a half, and the
        plan's predicted peak."""
        self._resolved = {}
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

    def set_profiled_peaks(self, peaks: Dict[Tuple[str, int], int]) -> None:
        """(phase, graph id) -> the profiled peak of each graph instance (complete profiles)."""
        self.profiled = dict(peaks)
        self._resolved = {}

    @property
    def active(self) -> bool:
        """Whether units must report their starts: recording, links to follow, or counting."""
        return self._recording or bool(self.links) or self.counting

    def started(self, phase: str, unit: Any) -> None:
        """``unit`` starts a half of ``phase``: count its first gathers (``counting``), then
        launch what follows it."""
        if self.counting:
            self._count(phase, unit)
        if self.links:
            self.launch_after(phase, unit.graph_id, unit.template_graph_id)

    def launch_after(self, phase: str, graph_id: int, template_graph_id: int) -> None:
        """Unit ``graph_id`` (of the graph compiled for ``template_graph_id``) starts a half of
        ``phase``: launch what follows it."""
        key = (phase, graph_id)
        resolved = self._resolved.get(key)
        if resolved is None:
            resolved = self._resolved[key] = self._resolve(phase, graph_id, template_graph_id)
        launches, held = resolved
        if held:
            self.held_back += 1
        for launch in launches:
            _prefetch(launch.graph_id, launch.ds_ids, launch.dtypes)
            self.launched += 1

    def report(self) -> Dict[str, Any]:
        """For ``engine.schedule_report()``: the links and what they launched or held back."""
        out = {"links": len(self.links), "launched": self.launched, "held_back_for_memory": self.held_back,
               "budget_bytes": self.budget_bytes}
        if self.counting:
            out.update(cold_units=self.cold_units, cold_params=self.cold_params, warm_params=self.warm_params,
                       eager_on_demand=self.eager_on_demand)
        return out

    def reset_counts(self) -> None:
        self.cold_units = self.cold_params = self.warm_params = self.eager_on_demand = 0

    # ---- inside --------------------------------------------------------------------------------

    def _head(self, phase: str, unit: Any) -> Optional[Launch]:
        """What ``unit`` gathers first in ``phase`` (None: unknown, its graph has no plan)."""
        if isinstance(unit, EagerUnit):
            return unit.head(phase)
        head = self.heads.get((phase, unit.template_graph_id))
        if head is None:
            return None
        return Launch(unit.graph_id, unit.ds_ids(head.ds_ids), head.dtypes, head.nbytes, head.numel)

    def _resolve(self, phase: str, graph_id: int, template_graph_id: int) -> Tuple[List[Launch], bool]:
        """The launches that follow unit ``graph_id``, and whether the budget cut them short."""
        launches: List[Launch] = []
        nbytes = numel = 0
        unit = self.links.get((phase, graph_id))
        seen = {graph_id}
        while unit is not None and unit.graph_id not in seen:
            seen.add(unit.graph_id)
            head = self._head(phase, unit)
            if head is None:
                break
            if head.ds_ids:
                if not self._fits(phase, graph_id, template_graph_id, nbytes + head.nbytes, numel + head.numel):
                    return launches, True
                launches.append(head)
                nbytes, numel = nbytes + head.nbytes, numel + head.numel
            if not (self.deep and isinstance(unit, EagerUnit)):
                break
            unit = self.links.get((phase, unit.graph_id))
        return launches, False

    def _fits(self, phase: str, graph_id: int, template_graph_id: int, nbytes: int, numel: int) -> bool:
        """Whether ``nbytes`` (``numel`` elements), held through the run of unit ``graph_id``,
        stay within the budget above that unit's predicted peak (unknown peak: they do not,
        unless there is no budget), and within ``max_live_numel`` above the elements its plan
        holds."""
        if self.max_live_numel is not None \
                and self.live.get((phase, template_graph_id), 0) + numel > self.max_live_numel:
            return False
        if self.budget_bytes is None:
            return True
        peak = self._predicted_peak(phase, graph_id, template_graph_id)
        return peak is not None and peak + nbytes <= self.budget_bytes

    def _predicted_peak(self, phase: str, graph_id: int, template_graph_id: int) -> Optional[int]:
        """Unit ``graph_id``'s own predicted peak: its profile plus what its graph's plan holds
        ahead (the plan's prediction above the profile it was made from); an eager unit: the
        largest profiled peak of ``phase``."""
        if graph_id < 0:
            return max((p for (ph, _), p in self.profiled.items() if ph == phase), default=None)
        planned = self.peaks.get((phase, template_graph_id))
        own = self.profiled.get((phase, graph_id))
        base = self.profiled.get((phase, template_graph_id))
        if planned is None or own is None or base is None:
            return planned
        return own + max(planned - base, 0)

    def _count(self, phase: str, unit: Any) -> None:
        head = self._head(phase, unit)
        if head is None or not head.ds_ids:
            return
        cold = sum(1 for i in head.ds_ids if not runtime.is_gathered(i))
        self.cold_params += cold
        self.warm_params += len(head.ds_ids) - cold
        if cold:
            self.cold_units += 1
            if isinstance(unit, EagerUnit):
                self.eager_on_demand += cold


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
