"""Every rule that involves more than one feature, one row each.

Three kinds of rows:

* ``REFUSALS``: combinations that cannot work, each an error naming a key and saying why. Rows
  marked ``"parse"`` need the config alone (``Config.from_dict`` reports them); rows marked
  ``"resolve"`` need what ``initialize`` knows (the completed batch sizes and the dtype the model
  trains in: :class:`Facts`, filled by ``auto.py``, the only module that looks at the model).
* ``NOTICES``: accepted settings that do nothing in this combination; the engine warns once.
* Derived settings: what a key means for the features it touches (``reduce_overlap``,
  ``optional_passes``, ``offload_switches``); the runtime reads these instead of re-deciding.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, FrozenSet, List, Optional, Tuple



@dataclasses.dataclass(frozen=True)
class Facts:
    """What a resolve-time rule may know beyond the config."""

    gradient_accumulation_steps: int = 1
    # dtype names ("float32", "bfloat16", ...) the trainable floating-point parameters train in;
    # empty when no model is known.
    trained_dtypes: FrozenSet[str] = frozenset()
    # The number of ranks; None when unknown.
    world_size: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Rule:
    key: str  # the dotted key the problem is reported under
    phase: str  # "parse" or "resolve"
    problem: Callable  # (config, facts) -> message, or None when the rule holds


# ---- refusals

_PARAM_OFFLOAD_STAGE = ("parameter offload applies to ZeRO-3's partitioned parameters; under ZeRO-{stage} every "
                        "rank holds whole parameters. Use stage 3, or offload_optimizer / compile.offload_opt_states "
                        "for the optimizer state and master partitions")


def _param_offload_stage(key: str, on: Callable) -> Callable:
    def problem(c, facts):
        if on(c) and c.zero_optimization.stage != 3:
            return f"{key}: " + _PARAM_OFFLOAD_STAGE.format(stage=c.zero_optimization.stage)
        return None
    return problem


_SIB = "compile.optimizer_step_in_backward"


def _step_in_backward(conflict: Callable) -> Callable:
    def problem(c, facts):
        if not c.compile.optimizer_step_in_backward:
            return None
        why = conflict(c)
        return f"{_SIB} cannot be used here: {why}; turn it off or change that setting" if why else None
    return problem


def _sib_stage(c) -> Optional[str]:
    z = c.zero_optimization
    if z.stage != 3:
        return (f"zero_optimization.stage is {z.stage}: it is built for ZeRO-3's per-parameter gradient partitions "
                "(ZeRO-1/2 reduce into flat partitions that span parameters)")
    return None


def _sib_clipping(c) -> Optional[str]:
    clip = c.gradient_clipping
    if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0:
        return (f"gradient_clipping is {c.gradient_clipping}: clipping scales every gradient by the global norm, which "
                "is known only after the last gradient, too late for a step in the backward")
    return None


def _sib_fp16(c) -> Optional[str]:
    if c.fp16.enabled is True:
        return ("fp16.enabled is true: a step in the backward updates parameters before the window's last gradient "
                "shows whether any overflowed, and an overflowed step is skipped on every rank (precision/)")
    return None


def _sib_offload(c) -> Optional[str]:
    z = c.zero_optimization
    offloads = [name for name, on in (("compile.offload_opt_states", c.compile.offload_opt_states),
                                      ("compile.offload_parameters", c.compile.offload_parameters),
                                      ("zero_optimization.offload_optimizer", z.offload_optimizer is not None),
                                      ("zero_optimization.offload_param", z.offload_param is not None)) if on]
    if offloads:
        return (f"{', '.join(offloads)} on: the offloaded step streams optimizer state and masters through host "
                "memory sub-group by sub-group after the backward")
    return None


def _both_half_precisions(c, facts) -> Optional[str]:
    if c.fp16.enabled is True and c.bf16.enabled is True:
        return "fp16.enabled and bf16.enabled are both true: training runs in one of the two dtypes; enable one"
    return None


def _limit_zero_vs_schedule(limit: str, pass_name: str, meaning: str) -> Callable:
    def problem(c, facts):
        z = c.zero_optimization
        if z.stage != 3 or getattr(z, limit) != 0 or c.compile.schedule is None:
            return None
        if any(pass_name in e["passes"] for e in c.compile.schedule):
            return (f"zero_optimization.{limit} is 0, which {meaning}, but compile.schedule runs {pass_name}; "
                    f"remove one of the two")
        return None
    return problem


def _bf16_reduce_accumulates(c, facts) -> Optional[str]:
    if c.communication_data_type == "bf16" and c.zero_optimization.stage == 3 \
            and facts.gradient_accumulation_steps != 1:
        return ("communication_data_type=\"bf16\" with ZeRO-3 needs gradient_accumulation_steps 1 (got "
                f"{facts.gradient_accumulation_steps}): the runtime allocates the gradient partitions in the reduce "
                "dtype, so micro-steps would accumulate in bf16. Reducing in bf16 into fp32 partitions needs a reduce "
                "dtype separate from the partition dtype in the C++ GradReducer")
    return None


def _z12_reduce_dtype(c, facts) -> Optional[str]:
    want = c.communication_data_type
    if want is None or c.zero_optimization.stage == 3:
        return None
    # What the engine casts the parameters to (precision/policy.py), else the model's own dtypes.
    trained = ({"bfloat16"} if c.bf16.enabled is True else {"float16"} if c.fp16.enabled is True
               else set(facts.trained_dtypes))
    wanted = "float32" if want == "fp32" else "bfloat16"
    if not trained or trained == {wanted}:
        return None
    return (f"communication_data_type=\"{want}\" with ZeRO-{c.zero_optimization.stage} is not supported for "
            f"parameters in {', '.join(sorted('torch.' + d for d in trained))}: ZeRO-1/2 reduce gradients in the "
            "parameters' dtype (register_z12_param takes no reduce dtype; the C++ runtime would need one, as "
            "register_z3_params has with expected_grad_dtypes). Leave it unset or make it match the parameters")


def _shard_size_divides_world(c, facts) -> Optional[str]:
    size = c.zero_optimization.mics_shard_size
    if size == -1 or facts.world_size is None or facts.world_size % size == 0:
        return None
    return (f"zero_optimization.mics_shard_size is {size}, which does not divide the world size {facts.world_size}: "
            "every shard group must have the same number of ranks")


def _hpz_stage(c, facts) -> Optional[str]:
    if c.zero_optimization.zero_hpz_partition_size > 1 and c.zero_optimization.stage != 3:
        return (f"zero_optimization.zero_hpz_partition_size is {c.zero_optimization.zero_hpz_partition_size} with "
                f"ZeRO-{c.zero_optimization.stage}: hpZ keeps a secondary copy of partitioned parameters, and only "
                "ZeRO-3 partitions them (ZeRO-1/2 parameters are whole on every rank). Leave it 1")
    return None


def _hpz_with_hybrid(c, facts) -> Optional[str]:
    hpz, shard = c.zero_optimization.zero_hpz_partition_size, c.zero_optimization.mics_shard_size
    if hpz == 1 or shard == -1 or shard == facts.world_size:
        return None
    return (f"zero_optimization.zero_hpz_partition_size ({hpz}) together with mics_shard_size ({shard}) is not "
            "supported: hybrid sharding already keeps every gather inside its shard group, so a secondary copy "
            "would only cost memory. Choose one of them")


def _hpz_divides_world(c, facts) -> Optional[str]:
    size = c.zero_optimization.zero_hpz_partition_size
    if size == 1 or facts.world_size is None or facts.world_size % size == 0:
        return None
    return (f"zero_optimization.zero_hpz_partition_size is {size}, which does not divide the world size "
            f"{facts.world_size}: every secondary group must have the same number of ranks")


def _sequence_parallel_divides_world(c, facts) -> Optional[str]:
    size = c.sequence_parallel_size
    if size == 1 or facts.world_size is None or facts.world_size % size == 0:
        return None
    return (f"sequence_parallel_size is {size}, which does not divide the world size {facts.world_size}: groups of "
            f"{size} consecutive ranks share each sequence")


def _sequence_parallel_needs_compile(c, facts) -> Optional[str]:
    if c.sequence_parallel_size > 1 and c.compile.auto_compile is False:
        return ("sequence_parallel_size > 1 with compile.auto_compile false: sequence parallelism is a graph pass "
                "(attention's all-to-alls are inserted into the compiled graph); uncompiled, every rank would "
                "attend over its own slice only. Leave auto_compile unset and call engine.compile()")
    return None


def _tiled_pass_needs_compile(key_name: str, what: str):
    def rule(c, facts) -> Optional[str]:
        if getattr(c.compile, key_name) and c.compile.auto_compile is False:
            return (f"compile.{key_name} with compile.auto_compile false: the {what} is a pass over the compiled "
                    "graph. Leave auto_compile unset and call engine.compile()")
        return None
    return rule


REFUSALS: Tuple[Rule, ...] = (
    Rule("zero_optimization.offload_param", "parse",
         _param_offload_stage("zero_optimization.offload_param", lambda c: c.zero_optimization.offload_param)),
    Rule("compile.offload_parameters", "parse",
         _param_offload_stage("compile.offload_parameters", lambda c: c.compile.offload_parameters)),
    Rule(_SIB, "parse", _step_in_backward(_sib_stage)),
    Rule(_SIB, "parse", _step_in_backward(_sib_clipping)),
    Rule(_SIB, "parse", _step_in_backward(_sib_offload)),
    Rule(_SIB, "resolve", _step_in_backward(_sib_fp16)),  # resolve: fp16.enabled may be "auto"
    Rule("fp16.enabled", "parse", _both_half_precisions),
    Rule("zero_optimization.stage3_max_live_parameters", "parse",
         _limit_zero_vs_schedule("stage3_max_live_parameters", "prefetch", "turns prefetching off")),
    Rule("zero_optimization.stage3_max_reuse_distance", "parse",
         _limit_zero_vs_schedule("stage3_max_reuse_distance", "selective_gather", "turns selective gathering off")),
    Rule("communication_data_type", "resolve", _bf16_reduce_accumulates),
    Rule("communication_data_type", "resolve", _z12_reduce_dtype),
    Rule("zero_optimization.mics_shard_size", "resolve", _shard_size_divides_world),
    Rule("zero_optimization.zero_hpz_partition_size", "parse", _hpz_stage),
    Rule("zero_optimization.zero_hpz_partition_size", "resolve", _hpz_with_hybrid),
    Rule("zero_optimization.zero_hpz_partition_size", "resolve", _hpz_divides_world),
    Rule("sequence_parallel_size", "resolve", _sequence_parallel_divides_world),
    Rule("sequence_parallel_size", "parse", _sequence_parallel_needs_compile),
    Rule("compile.packed_sequences", "parse", _tiled_pass_needs_compile("packed_sequences", "packed attention")),
    Rule("compile.tiled_loss", "parse", _tiled_pass_needs_compile("tiled_loss", "tiled loss")),
    Rule("compile.tiled_mlp", "parse", _tiled_pass_needs_compile("tiled_mlp", "tiled MLP")),
)


def refusals(config, phase: str, facts: Facts = Facts(), valid: Callable[[str], bool] = lambda key: True
             ) -> List[Tuple[str, str]]:
    """The ``(key, message)`` of every row of ``phase`` that the config breaks.

    ``valid(key)``: the key passed its own check (a row about a key already refused is skipped).
    """
    out = []
    for rule in REFUSALS:
        if rule.phase != phase or not valid(rule.key):
            continue
        message = rule.problem(config, facts)
        if message:
            out.append((rule.key, message))
    return out


# ---- notices


def _schedule_below_zero3(c) -> Optional[str]:
    if c.zero_optimization.stage != 3 and c.compile.schedule:
        return (f"compile.schedule holds ZeRO-3 passes only; it has no effect with stage {c.zero_optimization.stage}")
    return None


NOTICES: Tuple[Callable, ...] = (_schedule_below_zero3,)


def notices(config) -> List[str]:
    """Warnings for accepted settings that this combination leaves without effect."""
    return [m for m in (n(config) for n in NOTICES) if m]


# ---- derived settings


def reduce_overlap(config) -> Tuple[bool, bool]:
    """``(double_buffer, sync_after_reduce)`` of the runtime.

    ``zero_optimization.overlap_comm: false`` asks for reductions that do not overlap the
    backward (DeepSpeed then reduces on the compute stream): one bucket, and the device waits
    after each ``reduce_grad``.
    """
    c = config.compile
    if config.zero_optimization.overlap_comm:
        return c.double_buffer, c.sync_after_reduce
    return False, True


def optional_passes(config) -> FrozenSet[str]:
    """The optional ZeRO-3 passes the default schedule runs after warm-up.

    DeepSpeed's ``stage3_max_live_parameters: 0`` prefetches nothing and
    ``stage3_max_reuse_distance: 0`` keeps no released parameter gathered: they turn the
    matching pass off whatever ``compile.prefetch`` / ``selective_gather`` say.
    """
    c, z = config.compile, config.zero_optimization
    on = (("prefetch", c.prefetch and z.stage3_max_live_parameters != 0),
          ("selective_gather", c.selective_gather and z.stage3_max_reuse_distance != 0))
    return frozenset(name for name, enabled in on if enabled)


@dataclasses.dataclass(frozen=True)
class OffloadSwitches:
    """What the offload keys turn on, before any memory budget is looked at.

    * ``compile.offload_opt_states: true``: offload what the memory budget requires (DeepCompile's
      switch); buffers are pinned.
    * ``zero_optimization.offload_optimizer: {"device": "cpu", ...}`` (DeepSpeed's switch): at
      least ``ratio`` (default 1.0: all) of the offloadable bytes, more if the budget requires;
      ``pin_memory`` (default false) chooses pinned buffers.
    * Both: the larger requirement holds, and buffers are pinned if either asks for it.
    * Parameter offload (ZeRO-3): ``compile.offload_parameters: true`` (pinned; the budget decides,
      after the optimizer state) or ``zero_optimization.offload_param: {"device": "cpu"}`` (every
      master shard goes). The optimizer's state is then offloaded only as far as the first two
      keys say: with neither, only what the budget requires.
    * Pinned buffers only on CUDA devices.
    """

    enabled_by: str  # the config key(s) that turned it on, for reports and errors
    min_fraction: float
    pin_memory: bool
    offload_masters: bool
    force_masters: bool
    offload_state: bool


def parameter_offload_keys(config) -> str:
    """The config key(s) that turn parameter offload on ("" when off)."""
    keys = [k for k, on in (("compile.offload_parameters", config.compile.offload_parameters),
                            ("zero_optimization.offload_param", config.zero_optimization.offload_param is not None))
            if on]
    return " and ".join(keys)


def offload_switches(config, device_type: str) -> Optional[OffloadSwitches]:
    """None when neither optimizer-state nor parameter offload is on."""
    by_compile = config.compile.offload_opt_states
    zero = config.zero_optimization.offload_optimizer
    params_by = parameter_offload_keys(config)
    if not by_compile and zero is None and not params_by:
        return None
    enabled_by = " and ".join([k for k, on in (("compile.offload_opt_states", by_compile),
                                                ("zero_optimization.offload_optimizer", zero is not None)) if on]
                              + ([params_by] if params_by else []))
    param = config.zero_optimization.offload_param
    pin = device_type == "cuda" and (by_compile or (zero is not None and zero.pin_memory)
                                     or config.compile.offload_parameters or (param is not None and param.pin_memory))
    return OffloadSwitches(enabled_by, zero.ratio if zero is not None else 0.0, pin,
                           offload_masters=bool(params_by), force_masters=param is not None,
                           offload_state=by_compile or zero is not None)
