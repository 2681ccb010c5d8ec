"""The graph passes of one compiled graph half, as data: an ordered list of entries.

Each entry names its pass, the halves it runs on, when it applies (ZeRO stage, activation
settings, what the graph holds), what it requires and what it provides. The list is checked when
it is built: every requirement is provided by an earlier entry, and the stages run in order.
The backend (``compiler/backend.py``) runs the list on each half it compiles; re-planning
(``compiler/replan.py``) re-runs the ``PLAN`` slice of the same list on the graph as it was
before that slice (``HalfPlan.base``).

Stages, in the order they run:

* ``STRUCTURE``: what the ZeRO stage and the activation settings make of the graph, fixed for
  the graph's life (gathers and releases, reductions, activation frees and offloads).
* ``PLAN``: what the schedule's current plan and profiles add (prefetch groups, where activation
  reloads start); ZeRO-3 keeps the graph from before this stage, so that a new plan re-runs it.
* ``LOWER``: ids become data (``passes/slot_ops.py``), right before the inner compiler, which
  may be deferred to a half's first compiled run.

Two steps before aot_autograd stay in ``DeepCompileBackend._compile_template``: the copies of
escaping parameter views and the graph-instance input both change what aot_autograd is handed.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

from torch.fx import GraphModule, Node

from deepcompile import compat, debug_checks
from deepcompile.passes import offload_activation
from deepcompile.passes.free_activation import insert_frees
from deepcompile.passes.prefetch import apply_prefetch
from deepcompile.passes.reduce import insert_reductions
from deepcompile.passes.saved_values import saved_values
from deepcompile.passes.slot_ops import to_slot_ops
from deepcompile.passes.zero3 import insert_gather_release

FORWARD, BACKWARD = "forward", "backward"
BOTH = (FORWARD, BACKWARD)


class Stage(enum.IntEnum):
    STRUCTURE = 0
    PLAN = 1
    LOWER = 2


@dataclasses.dataclass
class HalfContext:
    """What the passes of one half read and write.

    ``record``: the backend's ``GraphRecord`` of the graph (the passes file the saved values,
    offload sites and reduced ids there, for the other half and the profiler); ``driver``: the
    schedule driver (plans and profiles; ``replan.PlanSource``); ``activations``: the
    ``compile.free_activation``/``offload_activation`` settings, or None; ``params``: forward
    parameter placeholder -> ds id (the backward's are found by the gather pass);
    ``graph_input``: the instance placeholder, for the lowering; ``reload_bytes_per_s``: the
    host-to-device bandwidth reloads are placed for. ``prefetch_plan`` and ``applied`` are the
    passes' output.
    """

    gm: GraphModule
    phase: str
    record: Any
    zero_stage: int
    driver: Any = None
    signature: Any = None
    activations: Any = None
    params: Dict[Node, int] = dataclasses.field(default_factory=dict)
    graph_input: Optional[Node] = None
    reload_bytes_per_s: Optional[Callable[[], float]] = None
    prefetch_plan: Any = None
    applied: List[str] = dataclasses.field(default_factory=list)

    @property
    def graph_id(self) -> int:
        return self.record.graph_id


@dataclasses.dataclass(frozen=True)
class PassEntry:
    name: str
    run: Callable[[HalfContext], None]
    stage: Stage
    phases: Tuple[str, ...] = BOTH
    applies: Callable[[HalfContext], bool] = lambda ctx: True
    requires: FrozenSet[str] = frozenset()
    provides: FrozenSet[str] = frozenset()


class PipelineError(ValueError):
    pass


class Pipeline:
    """An ordered, checked list of :class:`PassEntry`."""

    def __init__(self, entries: Sequence[PassEntry]):
        self.entries: Tuple[PassEntry, ...] = tuple(entries)
        _check(self.entries)

    @property
    def names(self) -> List[str]:
        return [e.name for e in self.entries]

    def run(self, ctx: HalfContext, stages: Iterable[Stage]) -> HalfContext:
        """Run the entries of ``stages`` that apply to ``ctx``'s half, in list order."""
        wanted = set(stages)
        for entry in self.entries:
            if entry.stage in wanted and ctx.phase in entry.phases and entry.applies(ctx):
                entry.run(ctx)
                ctx.applied.append(entry.name)
        return ctx


def _check(entries: Sequence[PassEntry]) -> None:
    """Every requirement is provided by an earlier entry; stages do not go backwards; names are unique."""
    provider: Dict[str, str] = {}
    for entry in entries:
        for label in entry.provides:
            provider.setdefault(label, entry.name)
    seen: Dict[str, str] = {}
    names = set()
    previous: Optional[PassEntry] = None
    for entry in entries:
        if entry.name in names:
            raise PipelineError(f"pass {entry.name!r} appears twice in the pipeline")
        names.add(entry.name)
        if previous is not None and entry.stage < previous.stage:
            raise PipelineError(f"pass {entry.name!r} ({entry.stage.name}) comes after pass {previous.name!r} "
                                f"({previous.stage.name}): stages run in order")
        for label in sorted(entry.requires):
            if label in seen:
                continue
            if label in provider:
                raise PipelineError(f"pass {entry.name!r} requires {label!r}, which pass {provider[label]!r} "
                                    "provides only after it: move it after that pass")
            raise PipelineError(f"pass {entry.name!r} requires {label!r}, which no pass of the pipeline provides")
        for label in entry.provides:
            seen.setdefault(label, entry.name)
        previous = entry


# ---- the passes, as the backend runs them --------------------------------------------------------


def _zero3(ctx: HalfContext) -> bool:
    return ctx.zero_stage == 3


def _reductions(ctx: HalfContext) -> None:
    record = ctx.record
    grad_slots = {compat.gradient_output_index(i): ds_id for i, ds_id in record.param_slots.items()}
    reductions = insert_reductions(ctx.gm, ctx.graph_id, grad_slots)
    record.reduced_ids = [node.args[2] for node in reductions]


def _gather_release(ctx: HalfContext) -> None:
    if ctx.phase == BACKWARD:
        ctx.params = compat.saved_forward_inputs(ctx.gm, ctx.record.fw_param_names)
    insert_gather_release(ctx.gm, ctx.graph_id, ctx.params)


def _check_placeholders(ctx: HalfContext) -> None:
    debug_checks.check_placeholders_only_gathered(ctx.gm, ctx.params, debug_checks.LEDGER.names, ctx.phase)


def _saved_values(ctx: HalfContext) -> None:
    ctx.record.saved = saved_values(ctx.gm, ctx.record.num_fwd_outputs)


def _insert_offloads(ctx: HalfContext) -> None:
    act = ctx.activations
    ctx.record.offload_sites = offload_activation.insert_offloads(
        ctx.gm, ctx.record.saved, act.device.type, act.min_offload_bytes)


def _insert_reloads(ctx: HalfContext) -> None:
    offload_activation.insert_reloads(ctx.gm, ctx.record.offload_sites)


def _insert_frees(ctx: HalfContext) -> None:
    insert_frees(ctx.gm, ctx.record.saved, ctx.activations.free_threshold)


def _prefetch(ctx: HalfContext) -> None:
    plan = ctx.driver.prefetch_plan(ctx.gm, ctx.signature)
    ctx.driver.chain.set_head(ctx.phase, ctx.graph_id, plan)
    if plan is not None:
        apply_prefetch(ctx.gm, ctx.graph_id, plan)
    ctx.prefetch_plan = plan


def _profiled_times(ctx: HalfContext) -> Optional[Dict[str, float]]:
    return offload_activation.profiled_times(ctx.driver.profiles.get(ctx.signature))


def _place_reloads(ctx: HalfContext) -> None:
    # Early enough to hide their copies behind the profiled nodes before them.
    offload_activation.place_reloads(ctx.gm, _profiled_times(ctx), ctx.reload_bytes_per_s())


def _to_slots(ctx: HalfContext) -> None:
    to_slot_ops(ctx.gm, ctx.graph_id, ctx.record.slot_ids, ctx.graph_input)


def _activation(flag: str) -> Callable[[HalfContext], bool]:
    return lambda ctx: ctx.activations is not None and bool(getattr(ctx.activations, flag))


def _has_offload_sites(ctx: HalfContext) -> bool:
    return bool(ctx.record.offload_sites)


def passes() -> List[PassEntry]:
    """The backend's passes in the order they run (``PIPELINE``)."""
    s = frozenset
    return [
        # Backward first: a release whose last use is pointwise can then be anchored on the
        # reduction that consumes its result (passes/zero3.py) instead of splitting that region.
        PassEntry("reduce_gradients", _reductions, Stage.STRUCTURE, (BACKWARD,), provides=s({"reductions"})),
        PassEntry("gather_release", _gather_release, Stage.STRUCTURE, applies=_zero3,
                  provides=s({"gathers"})),
        PassEntry("check_placeholders", _check_placeholders, Stage.STRUCTURE,
                  applies=lambda ctx: _zero3(ctx) and debug_checks.LEDGER is not None, requires=s({"gathers"})),
        PassEntry("saved_values", _saved_values, Stage.STRUCTURE, (FORWARD,),
                  applies=lambda ctx: ctx.activations is not None, provides=s({"saved_values"})),
        PassEntry("offload_activations", _insert_offloads, Stage.STRUCTURE, (FORWARD,), applies=_activation("offload"),
                  requires=s({"saved_values"}), provides=s({"offload_sites"})),
        PassEntry("reload_activations", _insert_reloads, Stage.STRUCTURE, (BACKWARD,),
                  applies=lambda ctx: ctx.activations is not None and _has_offload_sites(ctx),
                  requires=s({"offload_sites"}), provides=s({"reloads"})),
        PassEntry("free_activations", _insert_frees, Stage.STRUCTURE, (BACKWARD,), applies=_activation("free"),
                  requires=s({"saved_values"})),
        PassEntry("prefetch", _prefetch, Stage.PLAN, applies=_zero3, requires=s({"gathers"}),
                  provides=s({"prefetch_plan"})),
        PassEntry("place_reloads", _place_reloads, Stage.PLAN, (BACKWARD,),
                  applies=lambda ctx: _has_offload_sites(ctx) and _profiled_times(ctx) is not None,
                  requires=s({"reloads"})),
        PassEntry("to_slot_ops", _to_slots, Stage.LOWER),
    ]


PIPELINE = Pipeline(passes())
