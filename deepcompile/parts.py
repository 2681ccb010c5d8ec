"""The training loop's optional features, as parts that the engine calls at fixed points.

The engine (``engine.py``) is the loop: forward, backward and, at an accumulation boundary, the
optimizer step. What acts inside that loop without being the loop itself (the step report's line
and timings, the debug checks, the joint offload plan, the optimizer step in the backward,
optimizer-state and parameter offload, activation memory) is a :class:`Part`: an object whose hooks
the engine calls at the points below. A part is built with what it needs and never reaches into
the engine or into another part; the engine tells it where the loop is (:class:`Moment`).

:func:`build_parts` is the one place that decides, from the config, which parts exist and in what
order their hooks run: at every point, in the order of its list. Adding a feature adds a part
there; the engine, the schedule report and the schedule driver stay as they are.

Where the engine calls each hook::

    forward()   the schedule decides whether this micro-step is profiled
                begin_micro_step, before_forward, enter_phase("forward"),
                the module runs, exit_phase("forward")
    backward()  the stage opens the backward (sharding.start_backward)
                before_backward, enter_phase("backward"), the backward runs, the schedule's
                micro-step ends, leftover eager reductions are flushed,
                exit_phase("backward"), after_backward
    step()      only at an accumulation boundary:
                at_boundary, enter_phase("step"), before_step, the stage's update,
                after_update, the loss scale moves and the LR schedule advances,
                exit_phase("step"), the step is counted, after_step, the schedule may switch plans
    destroy()   close
    the schedule report, each time it is read: report(into)

Why the order within a point matters: the joint plan is redone before the kinds it plans for act
on it (``before_step``); the optimizer step in the backward is armed before optimizer-state
offload starts its reloads (``before_backward``). :data:`ORDER` states the order once;
``tests/engine/test_parts.py`` holds it.

Loss scaling (fp16) is not a part: it is a value every step reads (the factor of the loss, the
scale the update divides out, whether the step is skipped), behind one interface with a no-op
stand-in for bf16 and fp32 (``precision/loss_scaler.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from deepcompile import debug_checks, runtime
from deepcompile.memory.budget import MemoryBudget, local_memory_budget
from deepcompile.offload import optimizer_state_offload
from deepcompile.offload.activations import activation_memory
from deepcompile.offload.joint import measured_compute, memory_planner
from deepcompile.offload.sides import ScheduleSide
from deepcompile.step_report import StepReport

# The hooks, in the order the loop reaches them (see above).
HOOKS = ("begin_micro_step", "before_forward", "before_backward", "after_backward", "at_boundary", "before_step",
         "after_update", "after_step", "enter_phase", "exit_phase", "report", "close")


@dataclasses.dataclass(frozen=True)
class Moment:
    """Where the loop is, as the engine tells its parts at every hook.

    ``global_steps``: optimizer steps done (after the step's count in ``after_step``);
    ``boundary``: this micro-step ends an accumulation window; ``schedule_mode``: what the schedule
    driver profiles in this micro-step (None, "plan" or "verify"); ``compiled``: what the forward
    runs when the module was compiled through the engine, else None."""
    global_steps: int
    boundary: bool
    schedule_mode: Optional[str] = None
    compiled: Any = None


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """An optimizer step, for ``after_step``: the global gradient norm before clipping (a device
    tensor), the learning rates the next step uses, the loss scale the step's gradients carried
    (fp16; else None)."""
    grad_norm: torch.Tensor
    lrs: List[float]
    loss_scale: Optional[float]


class Part:
    """One feature of the training loop. Every hook does nothing here; a part overrides those it
    needs (the engine calls only overridden ones). ``name``: how the engine and the tests name it;
    ``feature``: the object it drives (what ``engine.offload`` and the like return)."""

    name = "part"
    feature: Any = None

    def begin_micro_step(self, moment: Moment) -> None:
        """A micro-step starts, before its forward."""

    def before_forward(self, moment: Moment, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """The forward is about to run on these inputs."""

    def before_backward(self, moment: Moment, loss: torch.Tensor, tokens: Any) -> None:
        """The backward of ``loss`` is about to run (``tokens``: what ``engine.backward`` got)."""

    def after_backward(self, moment: Moment, loss: torch.Tensor) -> None:
        """The backward ran and every reduction of it is done."""

    def at_boundary(self, moment: Moment) -> None:
        """The accumulation window is complete; the optimizer step has not started."""

    def before_step(self, moment: Moment) -> None:
        """Right before the stage's optimizer update."""

    def after_update(self, moment: Moment) -> None:
        """Right after the stage's optimizer update, before the loss scale and LR schedule move."""

    def after_step(self, moment: Moment, outcome: StepOutcome) -> None:
        """The optimizer step is done and counted (``moment.global_steps``)."""

    def enter_phase(self, moment: Moment, phase: str) -> None:
        """``phase`` ("forward", "backward" or "step") starts: what timings measure."""

    def exit_phase(self, moment: Moment, phase: str) -> None:
        """``phase`` ended."""

    def report(self, into: Dict[str, Any]) -> None:
        """Add this part's section to the schedule report (``engine.schedule_report()``)."""

    def close(self) -> None:
        """The engine is destroyed."""


def overrides(part: Part, hook: str) -> bool:
    return getattr(type(part), hook) is not getattr(Part, hook)


def hooks_at(parts: Sequence[Part]) -> Dict[str, List[Callable[..., None]]]:
    """For each hook, the bound hooks of the parts that override it, in the parts' order: what the
    engine calls (a part's no-op hooks cost nothing)."""
    return {hook: [getattr(p, hook) for p in parts if overrides(p, hook)] for hook in HOOKS}


def hook_order(parts: Sequence[Part]) -> Dict[str, List[str]]:
    """For each hook, the names of the parts that act there, in call order."""
    return {hook: [p.name for p in parts if overrides(p, hook)] for hook in HOOKS}


# ---- the parts ----------------------------------------------------------------------------------


class StepReportPart(Part):
    """``steps_per_print`` and ``wall_clock_breakdown`` (step_report.py): always on."""

    name = "step_report"

    def __init__(self, step_report: StepReport, group: Optional[dist.ProcessGroup], sharding: Any = None):
        self.feature = step_report
        self.group = group
        self.sharding = sharding  # its own collectives count in the step's bytes (take_comm_bytes)

    def before_forward(self, moment, args, kwargs):
        self.feature.count_tokens(args, kwargs)

    def before_backward(self, moment, loss, tokens):
        self.feature.after_micro_step(loss, tokens)

    def enter_phase(self, moment, phase):
        self.feature.start(phase)

    def exit_phase(self, moment, phase):
        self.feature.stop(phase)

    def after_step(self, moment, outcome):
        # This step's collectives since the previous step: the runtime's, and those the stage
        # issues through torch.distributed (ZeRO-1/2's all-gather of the updated partitions).
        extra = self.sharding.take_comm_bytes() if self.sharding is not None else {}
        self.feature.comm_bytes = with_stage_bytes(runtime.comm_bytes(reset=True), extra)
        self.feature.after_optimizer_step(moment.global_steps, outcome.lrs, outcome.grad_norm, self.group,
                                          loss_scale=outcome.loss_scale)


def with_stage_bytes(counted: Dict[str, Dict[str, int]],
                     extra: Dict[str, Dict[str, int]]) -> Dict[str, Dict[str, int]]:
    """``runtime.comm_bytes``'s per-link counts with a stage's own payload bytes added (per link
    and kind), each touched link's ``wire`` recomputed from its payloads by the runtime's ring
    factors, so the report's ``wire`` stays what those payloads cost, rounded once."""
    for link, kinds in extra.items():
        entry = counted[link]
        for kind, nbytes in kinds.items():
            entry[kind] += int(nbytes)
        entry["wire"] = runtime.wire_bytes({k: entry[k] for k in runtime.COLLECTIVE_KINDS}, entry["ranks"])
    return counted


class DebugChecksPart(Part):
    """``compile.debug_checks`` (debug_checks.py): the reduction ledger, installed while the
    engine lives, checked at every accumulation boundary; the loss and the reduced gradients are
    finite."""

    name = "debug_checks"

    def __init__(self, param_names: Dict[int, str], loss_scaling: bool):
        self.feature = debug_checks.ReductionLedger(param_names)
        self.loss_scaling = loss_scaling
        debug_checks.install(self.feature)

    def after_backward(self, moment, loss):
        debug_checks.check_finite("the loss", {"loss": loss.detach()})

    def at_boundary(self, moment):
        ledger = self.feature
        ledger.check_window(runtime.reduce_counts())
        if self.loss_scaling:
            return  # fp16: an overflow is expected now and then; the step skips it (precision/)
        grads = {name: runtime.grad_target(ds_id) for ds_id, name in ledger.names.items()}
        debug_checks.check_finite("reduced gradients", grads)

    def close(self):
        if debug_checks.LEDGER is self.feature:
            debug_checks.install(None)


class MemoryPlannerPart(Part):
    """The memory planner (offload/joint.py) where the joint plan is on (optimizer-state or
    parameter offload): what is resident when the schedule profiles, the plan redone after a
    schedule switch, before the kinds act on it; its report. (The planner's other points are
    where the kinds report to it: ``OptimizerStateOffloadPart``, ``ActivationsPart``.)"""

    name = "joint_offload"

    def __init__(self, planner: Any):
        self.feature = planner

    def before_forward(self, moment, args, kwargs):
        self.feature.note_micro_step(moment.schedule_mode)

    def before_step(self, moment):
        self.feature.at_schedule_switch()

    def report(self, into):
        into["offload_plan"] = self.feature.report()


class BackwardStepPart(Part):
    """``compile.optimizer_step_in_backward`` (zero/backward_step.py): armed before each backward;
    the compiled backward graphs step through it (compiler/backend.py); the stage closes it."""

    name = "backward_step"

    def __init__(self, backward_step: Any):
        self.feature = backward_step

    def before_backward(self, moment, loss, tokens):
        self.feature.begin_backward(moment.boundary, profiled=moment.schedule_mode is not None)


class OptimizerStateOffloadPart(Part):
    """``compile.offload_opt_states`` / ``zero_optimization.offload_optimizer`` and parameter
    offload (offload/opt_states.py). After the update the offload finds what the step created or
    replaced, the memory planner decides from it whether to plan, then the units are written back
    as planned."""

    name = "optimizer_state_offload"

    def __init__(self, offload: Any, planner: Any):
        self.feature = offload
        self.planner = planner

    def before_backward(self, moment, loss, tokens):
        self.feature.before_backward(moment.boundary)

    def before_step(self, moment):
        self.feature.before_step()

    def after_update(self, moment):
        self.planner.after_state_change(self.feature.after_step())
        self.feature.write_back()

    def report(self, into):
        into["optimizer_state_offload"] = self.feature.report()

    def close(self):
        self.feature.close()


class ActivationsPart(Part):
    """``compile.free_activation`` / ``compile.offload_activation`` (offload/activations.py).
    ``planner``: the memory planner when activation offload is on (it plans at the activations'
    point of the step, after the other kinds' ``before_step``), else None."""

    name = "activations"

    def __init__(self, activations: Any, planner: Any = None):
        self.feature = activations
        self.planner = planner

    def begin_micro_step(self, moment):
        self.feature.check_runs_compiled(moment.compiled)
        self.feature.begin_micro_step()

    def before_step(self, moment):
        if self.planner is not None:
            self.planner.at_activation_window(moment.global_steps)

    def report(self, into):
        into["activations"] = self.feature.report()

    def close(self):
        self.feature.close()


# The order of every hook, stated once: each point calls the parts that are on in this order.
ORDER = (StepReportPart, DebugChecksPart, MemoryPlannerPart, BackwardStepPart, OptimizerStateOffloadPart,
         ActivationsPart)


def build_parts(config: Any, *, sharding: Any, schedule: Any, step_report: StepReport, device: torch.device,
                group: Optional[dist.ProcessGroup], budget: Optional[MemoryBudget],
                loss_scaling: bool) -> List[Part]:
    """The engine's parts for ``config``, in :data:`ORDER`. ``sharding``: the stage;
    ``schedule``: the schedule driver (the joint plan reads its profiles and switches);
    ``step_report``: the engine's; ``budget``: the device memory every planner keeps to;
    ``loss_scaling``: fp16's loss scaling is on (the debug checks then allow overflows).

    Built in the order the features depend on each other (the memory planner takes the kinds it
    plans for), then listed in :data:`ORDER`."""
    micro_steps = config.gradient_accumulation_steps
    if budget is None:
        budget = local_memory_budget(config.compile, device)
    built: List[Part] = [StepReportPart(step_report, group, sharding)]
    # compile.offload_opt_states / zero_optimization.offload_optimizer (deepcompile/offload/).
    offload = optimizer_state_offload(config, sharding, device, group, budget)
    units = offload.side if offload is not None else None
    # compile.free_activation / offload_activation (offload/activations.py); its floor leaves the
    # optimizer-state side's resident units out (the plan counts them as their own).
    activations = activation_memory(config, device, budget,
                                    resident_elsewhere=units.resident_bytes if units is not None else None)
    # One owner of the offload plan and of when it is made (offload/joint.py), whenever a kind
    # it plans is on; the pass schedule is a side of it too.
    planner = memory_planner(units, activations, ScheduleSide(schedule, device.type == "cuda"), budget, micro_steps,
                             lambda: measured_compute(schedule, step_report, micro_steps), device, group)
    if offload is not None:
        built.append(OptimizerStateOffloadPart(offload, planner))
        built.append(MemoryPlannerPart(planner))
    if activations is not None:
        built.append(ActivationsPart(activations, planner))
    if sharding.backward_step is not None:  # compile.optimizer_step_in_backward
        built.append(BackwardStepPart(sharding.backward_step))
    if config.compile.debug_checks:
        built.append(DebugChecksPart(sharding.param_names(), loss_scaling))
    return sorted(built, key=lambda p: ORDER.index(type(p)))
