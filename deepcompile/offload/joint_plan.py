"""One offload plan for activations, optimizer state and master shards, under one memory budget.

Pure arithmetic on byte counts and seconds (tests/offload/test_joint_plan.py); the engine side, which
gathers the measurements and applies the decision, is ``offload/joint.py``.

Memory. ``fb_floor`` is the forward/backward peak with every candidate off the device and
``step_floor`` the optimizer step's (``plan.py``). A candidate left resident adds its bytes to the
forward/backward peak; optimizer state and master shards add to the step's too when the step
streams (ZeRO-3 sub-groups; otherwise ``step_floor`` already holds all of them, reloaded). The
plan must bring both under the budget; when offloading every movable candidate does not,
:class:`~deepcompile.offload.plan.OffloadBudgetError` names the minimum.

Time. Per optimizer step (``micro_steps`` forward/backward pairs), with ``F``, ``B`` and ``S`` the
measured forward, backward and step compute times and the two copy directions on lanes of their
own (``lanes.py``), each kind moves:

* an activation: one offload in the forward, one reload in the backward, per micro-step;
* optimizer state: one write-back after the step (hidden behind the next forward and backward)
  and one reload for the step: behind what the backward leaves of its lane, but only as far as
  the budget's headroom lets reloads start there (``opt_states.py``: "early" units); the rest
  behind the step when it streams (ZeRO-3 sub-groups), fully exposed when it does not (ZeRO-1/2
  wait for every reload before stepping);
* a master shard: one write-back after the step, before the forward's gather reads it, and a read
  from the host at every gather, forward and backward, per micro-step.

Per phase, the lane that needs longer than the phase's compute exposes the difference: that is
the *exposed* transfer time, which the step really waits for. Activations are placed in their
phase when their position is known (``Candidate.position``, the fraction of the forward before the
tensor is computed): an activation's offload cannot start before it exists, and the backward needs
it back at the mirrored point, ``1 - position`` of the way through. So the copy lanes are played
through one micro-step, the offloads in forward order, the reloads in the order the backward needs
them (each as early as the lane allows): an activation computed late in the forward, needed early
in the backward, has little compute to hide behind, and the plan prefers to offload early ones.
Without positions (0 for all) this is the whole-phase comparison above. The plan offloads, until
both peaks fit, the candidate that adds the least exposed time per byte saved; among equals, the least
transfer time per byte, then optimizer state before activations before master shards (the
cheaper and simpler to undo first). Within a kind, the smallest candidate that alone covers what
is still missing completes the plan, else the largest goes and the search goes on; among equal
sizes the activation computed earliest.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from deepcompile.offload.plan import OffloadBudgetError

ACTIVATION = "activation"
OPTIMIZER_STATE = "optimizer_state"
MASTER = "master"
KINDS = (OPTIMIZER_STATE, ACTIVATION, MASTER)  # tie order


@dataclasses.dataclass(frozen=True)
class Candidate:
    key: Any  # the caller's handle (activation site key, storage key)
    kind: str  # ACTIVATION | OPTIMIZER_STATE | MASTER
    nbytes: int
    forced: bool = False  # offloaded whatever the budget (zero_optimization.offload_param)
    eligible: bool = True  # its kind is on
    # Activations: the fraction of a micro-step's forward before this tensor is computed (0: at
    # the start, the whole forward and backward to hide its copies in).
    position: float = 0.0


@dataclasses.dataclass(frozen=True)
class ComputeTimes:
    """Seconds of compute per optimizer step that copies can hide behind (all micro-steps)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    step_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Link:
    host_to_device: float  # bytes per second
    device_to_host: float


@dataclasses.dataclass(frozen=True)
class JointPlan:
    offloaded: List[bool]  # per candidate, in the order given
    offloaded_bytes: Dict[str, int]  # per kind
    resident_bytes: Dict[str, int]
    transfer_s: Dict[str, float]  # per kind, per optimizer step
    exposed_s: Dict[str, float]  # per kind: what the step would save without that kind's copies
    exposed_total_s: float
    predicted_fb_peak: int
    predicted_step_peak: int
    headroom: Optional[int]  # budget left above the predicted peaks (None: no budget)

    @property
    def predicted_peak(self) -> int:
        return max(self.predicted_fb_peak, self.predicted_step_peak)


def _over(load: float, window: float) -> float:
    return max(0.0, load - window)


def _activation_lanes(activations: Sequence[Tuple[int, float]], link: Link, forward_s: float,
                      backward_s: float) -> Tuple[float, float]:
    """One micro-step's activation copies, (bytes, position) each, played through the lanes:
    (seconds the offloads run past the forward's end, seconds the backward waits for reloads)."""
    lane = 0.0
    for nbytes, position in sorted(activations, key=lambda a: a[1]):
        lane = max(lane, position * forward_s) + nbytes / link.device_to_host
    forward_spill = _over(lane, forward_s)
    lane, waited = 0.0, 0.0
    for nbytes, position in sorted(activations, key=lambda a: -a[1]):  # the backward's order of need
        lane += nbytes / link.host_to_device
        needed = (1.0 - position) * backward_s + waited  # the backward is late by what it waited so far
        waited += _over(lane, needed)
    return forward_spill, waited


def exposed_seconds(bytes_by_kind: Dict[str, int], link: Link, compute: ComputeTimes, micro_steps: int = 1,
                    streams: bool = True, early_state_bytes: Optional[int] = None,
                    activations: Optional[Sequence[Tuple[int, float]]] = None) -> float:
    """The transfer time per optimizer step that no compute hides (see the module docstring).
    ``early_state_bytes``: how much offloaded optimizer state may reload during the backward (the
    budget's headroom; None: all of it). ``activations``: the offloaded activations of one
    micro-step as (bytes, position), to place them in their phases (None: each phase's total
    alone, as if every activation had the whole phase)."""
    a = bytes_by_kind.get(ACTIVATION, 0) * micro_steps
    o = bytes_by_kind.get(OPTIMIZER_STATE, 0)
    m = bytes_by_kind.get(MASTER, 0)
    h2d, d2h = link.host_to_device, link.device_to_host
    F, B, S = compute.forward_s, compute.backward_s, compute.step_s
    # Forward: the host-to-device lane reads master shards for the gathers; the other lane offloads
    # activations and writes back the masters (each before its gather).
    fwd_h2d = m * micro_steps / h2d
    fwd_d2h = a / d2h + m / d2h
    # Backward: gathers read masters again, activations come back.
    bwd_h2d = (a + m * micro_steps) / h2d
    # Optimizer state: written back behind whatever the forward and backward leave of their
    # device-to-host lane; reloaded behind what the backward leaves of the other lane, then the step.
    wb = o / d2h
    wb_spill_fwd = _over(wb, max(0.0, F - fwd_d2h))
    wb_spill_bwd = _over(wb_spill_fwd, B)
    early = o if early_state_bytes is None else min(o, max(0, early_state_bytes))
    late = (o - early) / h2d + _over(early / h2d, max(0.0, B - bwd_h2d))
    reload_spill = _over(late, S) if streams else late
    forward = max(_over(fwd_h2d, F), _over(fwd_d2h, F))
    backward = max(_over(bwd_h2d, B), wb_spill_bwd)
    if activations:
        spill, waited = _activation_lanes(activations, link, F / micro_steps, B / micro_steps)
        forward = max(forward, spill * micro_steps)
        backward = max(backward, waited * micro_steps)
    return forward + backward + reload_spill


def transfer_seconds(kind: str, nbytes: int, link: Link, micro_steps: int = 1) -> float:
    """Copy time per optimizer step that offloading ``nbytes`` of ``kind`` costs, hidden or not."""
    h2d, d2h = 1.0 / link.host_to_device, 1.0 / link.device_to_host
    if kind == ACTIVATION:
        return nbytes * micro_steps * (h2d + d2h)
    if kind == OPTIMIZER_STATE:
        return nbytes * (h2d + d2h)
    return nbytes * (2 * micro_steps * h2d + d2h)


@dataclasses.dataclass(frozen=True)
class _Choices:
    """The plan's arithmetic over one set of candidates: per choice (``flags``, one per candidate:
    offloaded), the bytes per kind, the two peaks and the exposed transfer time."""

    candidates: Sequence[Candidate]
    budget: Optional[int]
    fb_floor: int
    step_floor: int
    streams: bool
    link: Link
    compute: ComputeTimes
    micro_steps: int

    def bytes_by_kind(self, flags: Sequence[bool], want: bool) -> Dict[str, int]:
        d = {k: 0 for k in KINDS}
        for c, f in zip(self.candidates, flags):
            if f == want:
                d[c.kind] += c.nbytes
        return d

    def peaks(self, flags: Sequence[bool]) -> Tuple[int, int]:
        res = self.bytes_by_kind(flags, False)
        fb = self.fb_floor + sum(res.values())
        step = self.step_floor + ((res[OPTIMIZER_STATE] + res[MASTER]) if self.streams else 0)
        return fb, step

    def exposed(self, moved: Dict[str, int], flags: Sequence[bool]) -> float:
        # Offloaded optimizer state reloads during the backward only within the headroom.
        early = None if self.budget is None else max(0, self.budget - max(self.peaks(flags)))
        placed = [(c.nbytes, c.position) for c, f in zip(self.candidates, flags) if f and c.kind == ACTIVATION] \
            if moved.get(ACTIVATION) else None
        return exposed_seconds(moved, self.link, self.compute, self.micro_steps, self.streams, early, placed)


def _check_minimum(candidates: Sequence[Candidate], movable: Sequence[bool], budget: int, fb_floor: int,
                   step_floor: int, streams: bool, budget_name: str) -> None:
    """Raise :class:`OffloadBudgetError` when even the smallest plan (everything movable offloaded)
    does not fit ``budget``."""
    # Must hold whatever is offloaded: the least any plan needs.
    fixed = sum(c.nbytes for c, m in zip(candidates, movable) if not m)
    fixed_step = sum(c.nbytes for c, m in zip(candidates, movable) if not m and c.kind != ACTIVATION)
    minimum = max(fb_floor + fixed, step_floor + (fixed_step if streams else 0))
    if budget < minimum:
        off = sorted({c.kind for c, m in zip(candidates, movable) if not m})
        raise OffloadBudgetError(
            f"offload: the memory budget ({budget_name} = {budget} bytes) is smaller than the smallest plan, "
            f"which needs {minimum} bytes on the device with every movable tensor on the host "
            f"(forward/backward without them: {fb_floor} bytes; the optimizer step: {step_floor} bytes"
            + (f"; kept on the device because their offload kind is off: {fixed} bytes of {', '.join(off)}"
               if fixed else "")
            + f"). Raise the budget to at least {minimum} bytes, turn more offload kinds on, or reduce the batch "
            "or the model")


def _offload_state_share(candidates: Sequence[Candidate], movable: Sequence[bool], out: List[bool],
                         min_state_fraction: float) -> None:
    """``offload_optimizer.ratio``: that much optimizer state goes first, largest first (in ``out``)."""
    state = [i for i, c in enumerate(candidates) if c.kind == OPTIMIZER_STATE and movable[i]]
    need_state = math.ceil(min_state_fraction * sum(candidates[i].nbytes for i in state))
    moved_state = sum(candidates[i].nbytes for i in state if out[i])
    for i in sorted(state, key=lambda i: (-candidates[i].nbytes, i)):
        if moved_state >= need_state:
            break
        if not out[i]:
            out[i] = True
            moved_state += candidates[i].nbytes


def _cheapest_next(choices: _Choices, movable: Sequence[bool], out: Sequence[bool], kinds: Sequence[str],
                   missing: int) -> int:
    """The candidate (of ``kinds``, not yet offloaded) whose offload adds the least exposed time
    per byte saved (see the module docstring for the ties and the pick within a kind)."""
    candidates = choices.candidates
    base = choices.exposed(choices.bytes_by_kind(out, True), out)
    best = None
    for rank, kind in enumerate(KINDS):
        if kind not in kinds:
            continue
        left = [i for i in range(len(candidates)) if movable[i] and not out[i] and candidates[i].kind == kind]
        if not left:
            continue
        finishing = [i for i in left if candidates[i].nbytes >= missing]
        # Among equal sizes the earliest activation: it has the most compute around it.
        pick = (min(finishing, key=lambda i: (candidates[i].nbytes, candidates[i].position, i)) if finishing
                else min(left, key=lambda i: (-candidates[i].nbytes, candidates[i].position, i)))
        size = max(candidates[pick].nbytes, 1)
        flags = list(out)
        flags[pick] = True
        extra = choices.exposed(choices.bytes_by_kind(flags, True), flags) - base
        # Relative rounding (1e-12 s per byte) must not decide between kinds that both hide.
        score = (round(extra / size, 15), round(transfer_seconds(kind, 1, choices.link, choices.micro_steps), 18),
                 rank)
        if best is None or score < best[0]:
            best = (score, pick)
    assert best is not None, "the budget check guarantees a movable candidate"
    return best[1]


def plan_jointly(candidates: Sequence[Candidate], budget: Optional[int], fb_floor: int, step_floor: int,
                 streams: bool, link: Link, compute: ComputeTimes, micro_steps: int = 1,
                 min_state_fraction: float = 0.0, budget_name: str = "the memory budget") -> JointPlan:
    """Choose what to offload among ``candidates``.

    ``budget``: device bytes (None: no budget, offload every eligible candidate, as each planner
    alone does without one). ``streams``: resident optimizer state and masters count against the
    step's peak too. ``min_state_fraction``: the least fraction of the eligible optimizer-state
    bytes to offload whatever the budget (``offload_optimizer.ratio``).
    """
    movable = [c.eligible or c.forced for c in candidates]
    out = [c.forced for c in candidates]
    if budget is None:
        out = list(movable)
    else:
        _check_minimum(candidates, movable, budget, fb_floor, step_floor, streams, budget_name)
    _offload_state_share(candidates, movable, out, min_state_fraction)
    choices = _Choices(candidates, budget, fb_floor, step_floor, streams, link, compute, micro_steps)
    if budget is not None:
        while True:
            fb, step = choices.peaks(out)
            fb_missing, step_missing = fb - budget, step - budget
            if fb_missing <= 0 and step_missing <= 0:
                break
            # The step's peak is lowered only by what it holds: optimizer state and masters.
            kinds = (OPTIMIZER_STATE, MASTER) if step_missing > 0 else KINDS
            missing = step_missing if step_missing > 0 else fb_missing
            out[_cheapest_next(choices, movable, out, kinds, missing)] = True

    moved = choices.bytes_by_kind(out, True)
    total = choices.exposed(moved, out)
    by_kind = {}
    for kind in KINDS:
        # What the step would save without this kind's copies (same peaks, so the same headroom).
        by_kind[kind] = total - choices.exposed(dict(moved, **{kind: 0}), out)
    fb, step = choices.peaks(out)
    return JointPlan(
        offloaded=out, offloaded_bytes=moved, resident_bytes=choices.bytes_by_kind(out, False),
        transfer_s={k: transfer_seconds(k, moved[k], link, micro_steps) for k in KINDS},
        exposed_s=by_kind, exposed_total_s=total, predicted_fb_peak=fb, predicted_step_peak=step,
        headroom=None if budget is None else budget - max(fb, step))
