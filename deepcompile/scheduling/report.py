"""The schedule report: what the profile-guided passes decided, and how it turned out.

Written by rank 0 when ``compile.report_dir`` is set (``schedule_step<N>.json`` and ``.txt``) and
printed when ``compile.debug_log`` is true. One report per schedule switch, in two stages:

* at the switch (``planned``): the entry, the memory budget, the all-gather time model, per graph
  its profile (time, peak) and prefetch plan (fused groups, where each is launched, ahead or at
  use), the persistent set (parameter, bytes, all-gather time saved per step) and the predicted
  peak memory; and the parameter elements the plan holds beyond the op in flight (kept gathered plus
  prefetched ahead) against DeepSpeed's ``stage3_max_live_parameters``;
* after the first micro-step under the new plan (``measured``): the peak of each graph measured by
  profiling that micro-step, next to the prediction.

``engine.schedule_report()`` returns the report as a :class:`ReportDict`: a plain dict, readable
as text with ``.to_text()`` or ``str()`` (:func:`format_schedule_report`, also
``deepcompile.format_schedule_report`` for a dict read back from JSON). At each switch rank 0 also
logs one line (:func:`summary_line`): prefetch groups, what stays gathered, what is offloaded and
the predicted peak against the budget.

Memory numbers are what the profiler measures: allocated device memory on GPU (so they include
the model and optimizer state), the graph's own working set on CPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from deepcompile.profiling.graph_profiler import GraphProfile


@dataclasses.dataclass(frozen=True)
class SwitchPeaks:
    """The peaks around the last schedule switch, for those who re-plan when it moved: the most
    a graph's profile showed before the switch and, with ``compile.verify_plan``, the most the
    switched graphs were measured at (None: not measured, which is not a peak of 0)."""

    step: int  # the optimizer step the switch took effect at
    profiled_peak_bytes: int
    measured_peak_bytes: Optional[int]


def _mib(n: Optional[int]) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def size_lines(sizes: Dict[str, Any]) -> List[str]:
    """The ``sizes`` section (zero/sizes.py): each DeepSpeed size key and what it became."""
    return [f"{key} {entry['elements']:,}: {entry['became']}" for key, entry in sizes.items()]


def _offload_lines(o: Dict[str, Any]) -> List[str]:
    lines = [f"optimizer-state offload ({o['enabled_by']}): {_mib(o['offloaded_bytes'])} on the host, "
             f"{_mib(o['resident_bytes'])} resident, {_mib(o['reloaded_during_backward_bytes'])} reloaded during the "
             f"backward; budget {o['budget']}" + (f" = {_mib(o['budget_bytes'])}" if o['budget_bytes'] else "")
             + (" (not planned yet: the plan is made after the first optimizer step)"
                if o["planned_after_step"] is None else "")]
    if o.get("predicted_transfer_s_per_step") is not None:
        bw = o["copy_bandwidth"]
        lines.append(f"  predicted transfer per step: {o['predicted_transfer_s_per_step'] * 1e3:.1f} ms each way, "
                     f"overlapped (measured link: host to device {bw['host_to_device'] / 1e9:.1f} GB/s, "
                     f"device to host {bw['device_to_host'] / 1e9:.1f} GB/s)")
    if o.get("predicted_peak_bytes") is not None:
        measured = o.get("measured_peak_bytes")
        lines.append(f"  predicted peak {_mib(o['predicted_peak_bytes'])}; measured "
                     + (f"{_mib(measured)} since the plan" if measured is not None else
                        f"not above the peak of the planning step ({_mib(o['peak_at_plan_bytes'])})"))
    lines += [f"    {t['tensor']}: {_mib(t['bytes'])}, " + (f"offloaded, reloaded {t['reload']}" if t["offloaded"]
                                                          else "resident") for t in o["tensors"]]
    return lines


def _activation_lines(a: Dict[str, Any]) -> List[str]:
    lines = [f"free_activation: {'on, over ' + _mib(a['free_activation_threshold_bytes']) if a['free_activation'] else 'off'}"]
    if a["offload_activation"]:
        lines.append(f"activation offload: {_mib(a['offloaded_bytes'])} offloaded, {_mib(a['resident_bytes'])} kept; "
                     f"predicted transfer {a['predicted_transfer_ms_per_step']:.4g} ms/step; budget {a['budget']}"
                     + ("" if a["planned_after_step"] is not None else " (everything offloaded until the plan, "
                        "made at the second optimizer step)"))
        lines += [f"    {t['tensor']}: {_mib(t['bytes'])}"
                  + (f" ({t['runs_per_micro_step']} runs per micro-step)" if t["runs_per_micro_step"] > 1 else "")
                  + ", " + _activation_fate(t) for t in a["tensors"]]
    return lines


def _activation_fate(t: Dict[str, Any]) -> str:
    if t["offloaded"] or not t["offloaded_bytes"]:
        return "offloaded" if t["offloaded"] else "kept"
    return f"{_mib(t['offloaded_bytes'])} offloaded (the first runs), the rest kept"


def _joint_lines(j: Dict[str, Any]) -> List[str]:
    if not j["planned"]:
        return [f"offload plan (joint): {j['note']}"]
    lines = [f"offload plan (joint), budget {j['budget']}: predicted peak {_mib(j['predicted_peak_bytes'])} "
             f"(forward/backward {_mib(j['predicted_forward_backward_peak_bytes'])}, step "
             f"{_mib(j['predicted_step_peak_bytes'])}), measured "
             + (_mib(j["measured_peak_bytes"]) + " since the plan" if j["measured_peak_bytes"] is not None
                else f"not above the peak at the plan ({_mib(j['peak_at_plan_bytes'])})")
             + f"; transfer {j['predicted_transfer_ms_per_step']:.4g} ms/step, exposed "
             f"{j['predicted_exposed_ms_per_step']:.4g} ms/step (compute from {j['compute_source']})"]
    for kind, k in j["kinds"].items():
        lines.append(f"    {kind}: {_mib(k['offloaded_bytes'])} offloaded, {_mib(k['resident_bytes'])} resident, "
                     f"transfer {k['predicted_transfer_ms_per_step']:.4g} ms/step, exposed "
                     f"{k['predicted_exposed_ms_per_step']:.4g} ms/step")
    lines += [f"    planned after step {h['after_step']}: {h['reason']}" for h in j["history"]]
    return lines


def _link_lines(links: Dict[str, Any]) -> List[str]:
    """Which communicator carries what (zero/links.py); nothing to say for one plain link."""
    if set(links) <= {"shard"}:
        return []
    lines = []
    for name, link in links.items():
        extra = (f"; secondary copies hold {_mib(link['secondary_copy_bytes'])}"
                 if "secondary_copy_bytes" in link else "")
        lines.append(f"link {name} ({link['ranks']} ranks): {', '.join(link['carries'])}{extra}")
    return lines


def _live_parameters(persistent_plan, prefetch_plans: Dict[Tuple, Any]) -> Dict[str, Any]:
    """The planned parameter elements held beyond the op in flight, and DeepSpeed's limits."""
    plans = list(prefetch_plans.values())
    peaks = [p.peak_live_numel for p in plans]
    if persistent_plan is not None:
        peaks.append(persistent_plan.peak_live_numel)
    limits = [p.max_live_numel for p in plans] + ([persistent_plan.max_live_numel] if persistent_plan else [])
    return {"planned_peak_numel": max(peaks, default=0),
            "max_live_parameters": next((x for x in limits if x is not None), None),
            "max_reuse_distance": persistent_plan.max_reuse_numel if persistent_plan is not None else None}


def _key(signature: Tuple) -> str:
    phase, ids, n_nodes = signature
    return f"{phase}[{len(ids)} gathers, {n_nodes} nodes]"


class ScheduleReport:
    """``compile_config``: the ``compile`` config section (``report_dir``, ``debug_log``); only
    ``rank`` 0 writes. ``param_names``: ds id -> parameter name."""

    def __init__(self, compile_config: Any, rank: int, param_names: Dict[int, str]):
        self.compile_config = compile_config
        self.rank = rank
        self.param_names = dict(param_names)
        self.current: Optional[Dict[str, Any]] = None
        self.history = []
        self.verify_profiles: Dict[Tuple, GraphProfile] = {}
        # Sections owned elsewhere (the engine's parts, deepcompile/parts.py: offload plans and
        # the like): objects with ``report(into)``, which add their section to the dict each time
        # the report is read. The report knows none of them by name.
        self.contributors: List[Any] = []
        # Set by the driver: prefetch across graphs (instance_chain.py).
        self.chain: Optional[Callable[[], Dict[str, Any]]] = None

    def planned(self, step: int, entry, budget: int, comm, profiles: Dict[Tuple, GraphProfile], persistent_plan,
                prefetch_plans: Dict[Tuple, Any]) -> None:
        """The plan made at the switch to ``entry`` after optimizer step ``step - 1``."""
        names = self.param_names
        graphs = []
        for sig, prof in profiles.items():
            plan = prefetch_plans.get(sig)
            predicted = plan.predicted_peak_bytes if plan is not None and plan.predicted_peak_bytes is not None \
                else prof.peak_bytes
            if persistent_plan is not None:
                predicted += sum(c.nbytes for c in persistent_plan.chosen)
            graphs.append({
                "graph": _key(sig),
                "graph_id": prof.graph_id,
                "phase": prof.phase,
                "profile_complete": prof.complete,
                "profile_error": prof.error,
                "profiled_time_ms": round(prof.total_time_ms, 3),
                "profiled_peak_bytes": prof.peak_bytes,
                "prefetch": [g.to_dict(names) for g in plan.groups] if plan is not None else None,
                "predicted_peak_bytes": predicted,
                "live_numel": plan.peak_live_numel if plan is not None else None,
                "measured_peak_bytes": None,
                "_sig": sig,
            })
        self.current = {
            "step": step,
            "entry": entry.describe(),
            "budget_bytes": budget,
            "comm_model": comm.to_dict() if comm is not None else None,
            "graphs": graphs,
            "persistent": [
                {"ds_id": c.ds_id, "param": names.get(c.ds_id, str(c.ds_id)), "bytes": c.nbytes,
                 "numel": c.numel, "reuse_distance": c.reuse_numel, "saved_ms_per_step": round(c.saved_ms, 4)}
                for c in (persistent_plan.chosen if persistent_plan is not None else [])
            ],
            "persistent_note": persistent_plan.skipped_reason if persistent_plan is not None else "selective_gather off",
            "live_parameters": _live_parameters(persistent_plan, prefetch_plans),
        }
        self.verify_profiles = {}
        self.history.append(self.current)
        self._emit()

    def measured(self, profiles: Dict[Tuple, GraphProfile]) -> None:
        if self.current is None:
            return
        for g in self.current["graphs"]:
            prof = profiles.get(g["_sig"])
            if prof is not None and prof.complete:
                g["measured_peak_bytes"] = prof.peak_bytes
        self._emit()

    def switch_peaks(self) -> Optional[SwitchPeaks]:
        """The peaks of the last switch as far as they are known (None: no switch yet)."""
        if self.current is None:
            return None
        graphs = self.current["graphs"]
        measured = [g["measured_peak_bytes"] for g in graphs if g["measured_peak_bytes"] is not None]
        return SwitchPeaks(self.current["step"], max((g["profiled_peak_bytes"] or 0 for g in graphs), default=0),
                           max(measured) if measured else None)

    # ---- output -------------------------------------------------------------------------------

    def as_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        if self.current is not None:
            out = dict(self.current)
            out["graphs"] = [{k: v for k, v in g.items() if k != "_sig"} for g in self.current["graphs"]]
            if self.chain is not None:
                out["prefetch_across_graphs"] = self.chain()
        for contributor in self.contributors:
            contributor.report(out)
        return out

    def text(self) -> str:
        return format_schedule_report(self.as_dict(), getattr(self.compile_config, "verify_plan", True))

    def switch_line(self) -> str:
        """One line on the switch just planned, for the run's log (:func:`summary_line`)."""
        return summary_line(self.as_dict())

    def snapshot(self) -> "ReportDict":
        """The report now, as ``engine.schedule_report()`` returns it."""
        return ReportDict(self.as_dict(), getattr(self.compile_config, "verify_plan", True))

    def _emit(self) -> None:
        cfg = self.compile_config
        if self.rank != 0:
            return
        if cfg.report_dir:
            os.makedirs(cfg.report_dir, exist_ok=True)
            base = os.path.join(cfg.report_dir, f"schedule_step{self.current['step']}")
            with open(base + ".json", "w", encoding="utf-8") as f:
                json.dump(self.as_dict(), f, indent=2)
            with open(base + ".txt", "w", encoding="utf-8") as f:
                f.write(self.text() + "\n")
        if cfg.debug_log:
            print(self.text(), flush=True)


def format_schedule_report(r: Dict[str, Any], verify_plan: bool = True) -> str:
    """``engine.schedule_report()`` as text: the switch's plan per graph (profile, prefetch
    groups, predicted and measured peaks), the persistent set and the offload plans.
    ``verify_plan``: whether measured peaks were to be expected (``compile.verify_plan``)."""
    offload = _offload_lines(r["optimizer_state_offload"]) if "optimizer_state_offload" in r else []
    if "activations" in r:
        offload += _activation_lines(r["activations"])
    if "offload_plan" in r:
        offload += _joint_lines(r["offload_plan"])
    offload += _link_lines(r.get("links", {}))
    offload += size_lines(r.get("sizes", {}))
    if "step" not in r:
        return "\n".join(["deepcompile schedule: no switch yet"] + offload)
    lines = [f"deepcompile schedule at optimizer step {r['step']}: {r['entry']}, budget {_mib(r['budget_bytes'])}"]
    for g in r["graphs"]:
        lines.append(
            f"  graph {g['graph_id']} {g['graph']}: profiled {g['profiled_time_ms']:.2f} ms, "
            + (f"gathers over {g['gather_link']}, " if g.get("gather_link", "shard") != "shard" else "")
            + f"peak {_mib(g['profiled_peak_bytes'])}; predicted peak {_mib(g['predicted_peak_bytes'])}, "
            + (f"measured {_mib(g['measured_peak_bytes'])}" if g["measured_peak_bytes"] is not None
               else "measured n/a" if verify_plan
               else "not measured (compile.verify_plan off)")
            + ("" if g["profile_complete"] else f" [profile incomplete: {g['profile_error']}]")
        )
        for grp in g["prefetch"] or []:
            where = "ahead, before" if grp["ahead"] else "at use, before"
            lines.append(f"    prefetch {len(grp['ds_ids'])} param(s), {_mib(grp['bytes'])}, {where} {grp['launch_before']}")
    total = sum(p["bytes"] for p in r["persistent"])
    lines.append(f"  persistent: {len(r['persistent'])} param(s), {_mib(total)}"
                 + (f" ({r['persistent_note']})" if r["persistent_note"] else ""))
    for p in r["persistent"]:
        lines.append(f"    {p['param']}: {_mib(p['bytes'])}, saves {p['saved_ms_per_step']} ms/step")
    live = r.get("live_parameters")
    if live and (live["max_live_parameters"] is not None or live["max_reuse_distance"] is not None):
        lines.append(f"  live parameters: at most {live['planned_peak_numel']} element(s) held beyond the op in "
                     f"flight (stage3_max_live_parameters {live['max_live_parameters']}, "
                     f"stage3_max_reuse_distance {live['max_reuse_distance']})")
    across = r.get("prefetch_across_graphs")
    if across and across["links"]:
        lines.append(f"  prefetch across graphs: {across['links']} link(s), {across['launched']} launched, "
                     f"{across['held_back_for_memory']} held back by the budget")
    return "\n".join(lines + offload)


def _offloaded(r: Dict[str, Any]) -> str:
    """What the offload plans in report ``r`` put on the host, in a few words."""
    parts = []
    joint = r.get("offload_plan")
    if joint and joint.get("planned"):
        parts += [f"{kind} {_mib(k['offloaded_bytes'])}" for kind, k in joint["kinds"].items() if k["offloaded_bytes"]]
    else:
        opt = r.get("optimizer_state_offload")
        if opt and opt.get("offloaded_bytes"):
            parts.append(f"optimizer states {_mib(opt['offloaded_bytes'])}")
        act = r.get("activations")
        if act and act.get("offload_activation") and act.get("offloaded_bytes"):
            parts.append(f"activations {_mib(act['offloaded_bytes'])}")
    return ", ".join(parts) if parts else "nothing"


def summary_line(r: Dict[str, Any]) -> str:
    """The schedule switch of report ``r`` in one line: the passes, the prefetch groups (and how
    many run ahead of their use), what stays gathered, what is offloaded, and the highest
    predicted peak against the memory budget."""
    graphs = r.get("graphs", [])
    groups = [g for graph in graphs for g in graph["prefetch"] or []]
    ahead = sum(1 for g in groups if g["ahead"])
    kept = sum(p["bytes"] for p in r.get("persistent", []))
    peaks = [g["predicted_peak_bytes"] for g in graphs if g["predicted_peak_bytes"] is not None]
    return (f"schedule switch at step {r['step']} ({r['entry']}): {len(groups)} prefetch group(s) in "
            f"{len(graphs)} graph(s), {ahead} ahead of use; {len(r.get('persistent', []))} parameter(s) kept "
            f"gathered ({_mib(kept)}); offloaded: {_offloaded(r)}; predicted peak "
            f"{_mib(max(peaks)) if peaks else 'n/a'} of a {_mib(r['budget_bytes'])} budget")


class ReportDict(dict):
    """``engine.schedule_report()``: the report as a plain dict (JSON-ready, read by key as
    before), plus :meth:`to_text` and ``str()`` for reading it."""

    def __init__(self, report: Dict[str, Any], verify_plan: bool = True):
        super().__init__(report)
        self.verify_plan = verify_plan

    def to_text(self) -> str:
        return format_schedule_report(self, self.verify_plan)

    def __str__(self) -> str:
        return self.to_text()
