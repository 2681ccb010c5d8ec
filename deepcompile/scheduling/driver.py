"""Runs the pass schedule of one engine: when to profile, when to re-plan, what the plan is.

Timeline for the default ZeRO-3 schedule (``warmup_steps`` W, passes P):

* steps 0 .. W-2: plain ZeRO-3 graphs;
* step W-1 (first micro-step of the window): every graph that runs is *profiled*: executed once by
  the profiler on the step's real inputs (its results are the step's results);
* end of step W-1 (optimizer step done, ``global_steps`` becomes W): the entry for step W is due
  and its profile exists, so the driver plans: the all-gather time model is measured once, the
  persistent set is chosen and applied (``set_persistent``), prefetch plans are kept for the
  recompile, and the module is recompiled with a fresh backend (``compiler/compiled_module.py``;
  Dynamo caches per backend, so nothing else is thrown away);
* step W (first micro-step): with ``compile.verify_plan``, the new graphs are profiled again to
  *measure* the plan; the schedule report (``compile.report_dir`` / ``compile.debug_log``) then
  shows predicted vs measured peaks. Without it (the default) step W is the first step that runs
  the planned graphs compiled, and the report says the peaks were not measured.

An entry that is due without a profile (a resumed run past the entry, ``warmup_steps`` 0) keeps
the current plan one more step while profiling, then switches: the schedule fires on
``step >= entry``, never on equality.

A profiling run that fails on any rank is aborted on all ranks at the same node (the failure vote
in ``profiling/graph_profiler.py``). The graph's profile is marked incomplete and the step is
finished by the compiled graph: for a forward graph, or a backward graph that has not reduced any
gradient yet, this is exact. A backward that already reduced gradients cannot be re-run without
reducing them twice, so that case raises on every rank.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch.fx import GraphModule

from deepcompile import runtime
from deepcompile.memory.budget import MemoryBudget, memory_budget
from deepcompile.profiling.comm_model import CommModel, measure_allgather
from deepcompile.profiling.graph_profiler import GraphProfile, ProfileAborted, profile_graph
from deepcompile.scheduling import planner
from deepcompile.scheduling.instance_chain import InstanceChain
from deepcompile.scheduling.instance_profiles import merged_profile
from deepcompile.scheduling.report import ScheduleReport, SwitchPeaks
from deepcompile.scheduling.schedule import PLAIN, PassSchedule, ScheduleEntry, needs_profile

log = logging.getLogger(__name__)


class ScheduleDriver:
    """Decides, per micro-step, which graphs are profiled and, per optimizer step, whether the
    plan changes. Knows nothing of the engine: it is handed what it reads.

    ``compile_config``: the ``compile`` config section (budget, report settings);
    ``schedule``: the pass schedule; ``prefetch_bucket_numel``: the largest fused gather;
    ``stage``, ``group``, ``device``, ``rank``: where the graphs run;
    ``accumulation_steps``: micro-steps per optimizer step; ``resident_ids``: parameters kept
    gathered from the start (the persistence threshold); ``param_names``: ds id -> name, for the
    report; ``budget``: the engine's memory budget (``deepcompile/memory/budget.py``), which the
    plans keep to; without one the driver agrees it over ``group`` when it first plans;
    ``max_live_numel`` / ``max_reuse_numel``: DeepSpeed's ``stage3_max_live_parameters`` /
    ``stage3_max_reuse_distance`` (None: no limit), which the plans keep to as well.
    """

    def __init__(self, compile_config: Any, schedule: PassSchedule, *, prefetch_bucket_numel: int, stage: int,
                 group: Optional[dist.ProcessGroup], device: torch.device, rank: int, accumulation_steps: int,
                 resident_ids: Sequence[int] = (), param_names: Optional[Dict[int, str]] = None,
                 budget: Optional[MemoryBudget] = None, max_live_numel: Optional[int] = None,
                 max_reuse_numel: Optional[int] = None, gather_group: Optional[dist.ProcessGroup] = None):
        self.compile_config = compile_config
        # Where ZeRO-3 gathers run (a shard group under hybrid sharding): the link the
        # communication model is measured on. None: ``group``.
        self.gather_group = gather_group
        self.schedule = schedule
        self.stage = stage
        self.group = group
        self.device = device
        self.rank = rank
        self.accumulation_steps = accumulation_steps
        self.resident_ids: List[int] = list(resident_ids)
        self.applied: ScheduleEntry = PLAIN
        self.max_group_numel = prefetch_bucket_numel
        self.chosen_persistent: List[int] = []
        self.comm: Optional[CommModel] = None
        self._budget: Optional[MemoryBudget] = budget
        self.max_live_numel = max_live_numel
        self.max_reuse_numel = max_reuse_numel
        # Profiles of the graphs as they ran in the last profiled micro-step, by graph signature.
        self.profiles: Dict[Tuple, GraphProfile] = {}
        self.graphs: Dict[Tuple, GraphModule] = {}
        self.gathers: Dict[Tuple, List[planner.Gather]] = {}
        self.mode: Optional[str] = None  # None | "plan" | "verify": what the current micro-step profiles
        self._profiled_now: Set[Tuple] = set()
        self._verify_pending = False
        self._fresh_profile = False
        self.report = ScheduleReport(compile_config, rank, param_names or {})
        self.fail_at: Optional[str] = None  # tests: node name whose profiling raises on this rank
        self._halves: List[Any] = []  # weak references to the compiled halves handed to torch
        self.chain = InstanceChain()  # prefetch across graphs (shared layer graphs)
        self.report.chain = self.chain.report

    # ---- compiled graphs --------------------------------------------------------------------

    def track(self, compiled_half: Any) -> None:
        self._halves.append(weakref.ref(compiled_half))

    def live_halves(self) -> List[Any]:
        """The compiled halves still alive and attached to this engine."""
        halves = [ref() for ref in self._halves]
        self._halves = [weakref.ref(h) for h in halves if h is not None]
        return [h for h in halves if h is not None and h.driver is self]

    def close(self) -> None:
        """The engine is destroyed: let go of every compiled half, graph and profile."""
        for ref in self._halves:
            half = ref()
            if half is not None:
                half.detach()
        self._halves = []
        self.graphs, self.gathers, self.profiles = {}, {}, {}
        self.report.verify_profiles = {}
        self.chain = InstanceChain()
        self.report.chain = None

    # ---- what the backend asks --------------------------------------------------------------

    @property
    def passes(self):
        return self.applied.passes

    def prefetch_plan(self, gm: GraphModule, signature: Tuple) -> Optional[planner.PrefetchPlan]:
        if "prefetch" not in self.applied.passes:
            return None
        profile = self._plan_profile(signature)
        return planner.plan_prefetch(
            gm, self.max_group_numel, resident=self._persistent_ids(), profile=profile,
            comm=self.comm, budget_bytes=self.budget_bytes() if profile is not None else None,
            max_live_numel=self.max_live_numel, kept_numel=self._kept_numel(),
        )

    def note_graph(self, signature: Tuple, gm: GraphModule) -> None:
        """Remember a compiled graph (after the ZeRO-3 pass, before prefetch) for planning."""
        self.graphs[signature] = gm
        self.gathers[signature] = planner.graph_gathers(gm)

    # ---- profiling --------------------------------------------------------------------------

    def begin_micro_step(self, global_steps: int, first_in_window: bool, can_profile: bool) -> None:
        """Called before each forward: decide whether this micro-step is profiled.

        ``can_profile``: graphs of this micro-step are compiled by a deepcompile backend of the
        current plan (only those can be run through the profiler).
        """
        self._profiled_now = set()
        self.mode = None
        if not first_in_window or not can_profile:
            return
        if self._verify_pending:
            self.mode = "verify"
        elif self._upcoming(global_steps) is not None:
            self.mode = "plan"
            self.chain.start_recording()
        if self.mode is not None and self.rank == 0:
            log.info("step %d: %s (each graph runs once under the profiler; this step is slower)", global_steps,
                     "profiling for the schedule" if self.mode == "plan" else "measuring the new schedule")

    def end_micro_step(self) -> None:
        self.chain.stop_recording()
        if self.mode == "verify":
            self._verify_pending = False
            self.report.measured(self.report.verify_profiles)
        elif self.mode == "plan" and self._profiled_now:
            self._fresh_profile = True
        self.mode = None

    def _upcoming(self, global_steps: int) -> Optional[ScheduleEntry]:
        """The entry that should be in force after the next optimizer step, if it differs."""
        target = self.schedule.entry_at(global_steps + 1)
        return target if target != self.applied else None

    def wants_profile(self, signature: Tuple) -> bool:
        return self.mode is not None and signature not in self._profiled_now

    def run_profiled(self, gm: GraphModule, args: List[Any], compiled: Callable, signature: Tuple,
                     graph_id: int, param_ids: Sequence[int]) -> Any:
        phase = signature[0]
        self._profiled_now.add(signature)
        try:
            outputs, profile = profile_graph(gm, list(args), graph_id, phase, self.device, self.group,
                                             fail_at=self.fail_at)
        except ProfileAborted as e:
            self._store(signature, GraphProfile(graph_id, phase, [], complete=False, error=str(e)))
            if e.reduced:
                raise RuntimeError(
                    f"deepcompile: {e}. The backward had already reduced gradients, so this step cannot be "
                    "finished; no rank continued alone."
                ) from e
            if self.rank == 0:
                log.warning("deepcompile: %s; finishing the step with the compiled graph", e)
            # Forget this graph's gather/release bookkeeping, then run it the normal way.
            runtime.register_graph(graph_id, list(param_ids), stage=self.stage)  # slot order
            runtime.clear_all_gathered_params()
            return compiled(args)
        args.clear()
        self._store(signature, profile)
        return outputs

    def _store(self, signature: Tuple, profile: GraphProfile) -> None:
        if self.mode == "verify":
            self.report.verify_profiles[signature] = profile
        else:
            self.profiles[signature] = profile

    # ---- the step boundary ------------------------------------------------------------------

    def on_optimizer_step(self, global_steps: int) -> bool:
        """After optimizer step ``global_steps - 1``: switch plans if an entry is due. True: the
        module must be recompiled."""
        due = self.schedule.entry_at(global_steps)
        if due == self.applied:
            return False
        if needs_profile(due) and not self._fresh_profile:
            return False  # profiled during the next step, applied after it
        self._switch(due, global_steps)
        return True

    def _switch(self, entry: ScheduleEntry, global_steps: int) -> None:
        self.applied = entry
        if "prefetch" in entry.passes:
            self.chain.build(self.group, self.device)  # collective, like the budget below
            self.chain.set_profiled_peaks({(p.phase, p.graph_id): p.peak_bytes
                                           for p in self.profiles.values() if p.complete})
            self.chain.budget_bytes = self.budget_bytes()
            self.chain.max_live_numel = self.max_live_numel
        else:
            self.chain.clear()
        if entry.passes and self.comm is None:
            gathers_over = self.gather_group if self.gather_group is not None else self.group
            self.comm = measure_allgather(gathers_over, self.device, max_bytes=self._largest_gather_bytes(),
                                          agree_group=self.group)
        for ds_id in self.chosen_persistent:
            runtime.set_persistent(ds_id, False)
        self.chosen_persistent = []
        persistent_plan = None
        if "selective_gather" in entry.passes:
            profiles = [self.profiles[s] for s in self.gathers if s in self.profiles]
            extra = self._prefetch_extra() if "prefetch" in entry.passes else 0
            persistent_plan = planner.plan_persistent(
                [self.gathers[s] for s in self.gathers if s in self.profiles], profiles, self.comm,
                self.budget_bytes(), self.accumulation_steps, extra,
                already=self.resident_ids, max_live_numel=self.max_live_numel, max_reuse_numel=self.max_reuse_numel,
                prefetch_extra_numel=self._prefetch_extra_numel() if "prefetch" in entry.passes else 0,
            )
            for ds_id in persistent_plan.ids:
                runtime.set_persistent(ds_id, True)
            self.chosen_persistent = persistent_plan.ids
        # compile.verify_plan: profile the new plan's graphs once (the report's measured peaks).
        self._verify_pending = bool(self.compile_config.verify_plan)
        self._fresh_profile = False
        self.report.planned(global_steps, entry, self.budget_bytes(), self.comm, dict(self.profiles), persistent_plan,
                            self._preview_prefetch() if "prefetch" in entry.passes else {})
        if self.rank == 0:
            log.info("%s", self.report.switch_line())

    def _preview_prefetch(self) -> Dict[Tuple, planner.PrefetchPlan]:
        """The prefetch plans the recompile will make (same inputs, so the same plans)."""
        return {
            sig: planner.plan_prefetch(gm, self.max_group_numel, resident=self._persistent_ids(),
                                       profile=self._plan_profile(sig), comm=self.comm,
                                       budget_bytes=self.budget_bytes(), max_live_numel=self.max_live_numel,
                                       kept_numel=self._kept_numel())
            for sig, gm in self.graphs.items() if sig in self.profiles
        }

    def _plan_profile(self, signature: Tuple) -> Optional[GraphProfile]:
        """The profile a graph is planned from: for a graph several instances share, merged
        over the instances (``instance_profiles.py``), since they all run its plan."""
        profile = self.profiles.get(signature)
        if profile is None or not profile.complete:
            return profile
        ids = self.chain.instances_of.get((profile.phase, profile.graph_id), ())
        others = [p for p in self.profiles.values() if p.phase == profile.phase and p.graph_id in ids
                  and p.graph_id != profile.graph_id]
        return merged_profile(profile, others) if others else profile

    def _prefetch_extra(self) -> int:
        """The most bytes any planned prefetch holds ahead of its use."""
        return max((p.max_ahead_bytes for p in self._preview_prefetch().values()), default=0)

    def _prefetch_extra_numel(self) -> int:
        """The most elements any planned prefetch holds ahead of its use."""
        return max((p.max_ahead_numel for p in self._preview_prefetch().values()), default=0)

    def _kept_numel(self) -> int:
        """The elements of the parameters selective unsharding keeps gathered."""
        chosen = set(self.chosen_persistent)
        numel = {g.ds_id: g.numel for gathers in self.gathers.values() for g in gathers if g.ds_id in chosen}
        return sum(numel.values())

    def _largest_gather_bytes(self) -> int:
        return max((g.nbytes for gathers in self.gathers.values() for g in gathers), default=1 << 20)

    def _persistent_ids(self) -> List[int]:
        return self.resident_ids + list(self.chosen_persistent)

    # ---- measurements for other planners (typed, so no one reads the report's dicts) ----------

    def compute_profiles(self) -> List[GraphProfile]:
        """The complete profiles of the schedule in force: those its first micro-step was measured
        with (``compile.verify_plan``), else those it was planned from."""
        return [p for p in self.report.verify_profiles.values() if p.complete] \
            or [p for p in self.profiles.values() if p.complete]

    def last_switch(self) -> Optional[SwitchPeaks]:
        """The last switch's peaks once they are final (after its verify micro-step, if one is
        due); None before any switch."""
        return None if self._verify_pending else self.report.switch_peaks()

    def budget_bytes(self) -> Optional[int]:
        """The bytes the plans keep to; None: no limit (a CPU device without
        ``compile.memory_budget_bytes``)."""
        if self._budget is None:
            self._budget = memory_budget(self.compile_config, self.device, self.group)  # collective
        return self._budget.bytes
