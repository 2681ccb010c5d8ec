"""User configuration: DeepSpeed's JSON config, as people write it, mapped onto deepcompile.

``deepcompile.initialize(model, optimizer, config)`` takes ``config`` as a dict, a path to a JSON
file or a :class:`Config`; :meth:`Config.from_any` turns each into a validated, immutable
:class:`Config`, and the engine then fills its ``"auto"`` values (:meth:`Config.resolve`).
``docs/config.md`` has the table of every key and how it is handled.

Compatibility policy
--------------------
* Key names, nesting and units are DeepSpeed's (``zero_optimization.reduce_bucket_size`` in
  elements, ``compile.free_activation_threshold`` in bytes, ...), so DeepSpeed configs, including
  the templates Hugging Face Trainer and accelerate ship, are read as they are.
* Nothing is accepted and then ignored. Every key is either implemented, or refused with an error
  that says why, or has no effect *by design* and is accepted only with the value that describes
  what the runtime does (``zero_optimization.overlap_comm: true``: communication always overlaps
  compute; ``false`` is an error that explains). Unknown keys are errors naming the dotted key and
  listing the keys of that section.
* All problems of a config are reported at once: :class:`ConfigError` (a ``ValueError``) carries
  every ``(dotted key, message)`` pair, so a config with three unsupported settings names all
  three.
* Types are strict: booleans must be ``true``/``false`` (not 0/1 or strings); integers reject
  booleans and non-integral floats, but integral floats such as ``5e8`` are accepted as ints.
* Two defaults differ from DeepSpeed's: ``compile.deepcompile`` is true (this package always
  compiles through its own passes) and ``zero_optimization.stage`` has no default (it is required:
  1, 2 or 3).
* ``compile`` also holds deepcompile's own scheduling keys (``warmup_steps``, ``prefetch``,
  ``selective_gather``, ``memory_budget_fraction``), which replace DeepSpeed's hard-coded schedule
  (design doc, compiler-passes.md §2.2).
* Two DeepSpeed aliases are read: ``bfloat16`` for ``bf16`` and
  ``zero_optimization.stage3_gather_fp16_weights_on_model_save`` for
  ``stage3_gather_16bit_weights_on_model_save``.

``"auto"``
----------
Hugging Face Trainer and accelerate write ``"auto"`` where they fill in a value before handing the
config to DeepSpeed. deepcompile fills what it can derive from the model and the world size, at
``initialize`` (:meth:`Config.resolve`), and refuses the rest with an error naming the key:

* ``train_batch_size`` / ``train_micro_batch_size_per_gpu`` / ``gradient_accumulation_steps``:
  one of the three may be ``"auto"``; it follows from the other two through
  ``train_batch_size = micro * gradient_accumulation_steps * world_size`` (an absent
  ``gradient_accumulation_steps`` counts as 1 there). Two or more ``"auto"`` cannot be derived.
* ``bf16.enabled`` / ``fp16.enabled``: true when the model's floating-point parameters are in
  that dtype (fp16 is then refused: it is not supported).
* ``zero_optimization.reduce_bucket_size``: ``hidden_size ** 2``;
  ``stage3_prefetch_bucket_size``: ``int(0.9 * hidden_size ** 2)``;
  ``stage3_param_persistence_threshold``: ``10 * hidden_size`` (the values HF Trainer derives),
  where ``hidden_size`` is ``model.config.hidden_size`` (or the largest of
  ``model.config.hidden_sizes``). A model without one gets the defaults of these keys; so does a
  stage-3 key under ZeRO-1/2, where it has no effect.
* ``zero_optimization.stage3_gather_16bit_weights_on_model_save``: accepted as is (no effect
  either way, see the key).
* ``scheduler.params.warmup_min_lr``: 0 (HF fills the same constant);
  ``scheduler.params.warmup_max_lr``: the optimizer's learning rate (per param group), which is
  what HF fills (``TrainingArguments.learning_rate``).
* Not derivable, an error: ``gradient_clipping`` (HF: ``max_grad_norm``), every
  ``optimizer.params`` value (HF: ``learning_rate``, ``adam_beta1/2``, ``adam_epsilon``,
  ``weight_decay``), ``scheduler.params.warmup_num_steps`` and ``total_num_steps`` (the training
  length), and any other key.

Every section is a frozen dataclass whose fields carry their validator and documentation
(``field.metadata["check"]``, ``["doc"]``, ``["auto"]``: how "auto" is derived, or None):
the dataclass *is* the table of supported keys. Validation runs in ``__post_init__``, so direct
construction and ``dataclasses.replace`` are validated too.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from deepcompile.scheduling.schedule import PASS_NAMES

__all__ = [
    "AUTO",
    "Config",
    "ConfigError",
    "ZeroConfig",
    "CompileConfig",
    "Bf16Config",
    "Fp16Config",
    "OptimizerConfig",
    "SchedulerConfig",
    "ActivationCheckpointingConfig",
    "TensorboardConfig",
    "CsvMonitorConfig",
    "WandbConfig",
    "HybridEngineConfig",
    "OPTIMIZER_TYPES",
    "SCHEDULER_TYPES",
]

AUTO = "auto"

# A validator takes the value and its full dotted key, returns the normalized value, and raises
# ValueError naming the key when the value is invalid.
Check = Callable[[Any, str], Any]

INFO = "Informational: accepted for DeepSpeed compatibility, no effect."


class ConfigError(ValueError):
    """Everything wrong with a config: ``problems`` is a list of ``(dotted key, message)``."""

    def __init__(self, problems: Sequence[Tuple[str, str]]):
        self.problems: List[Tuple[str, str]] = list(problems)
        if len(self.problems) == 1:
            text = self.problems[0][1]
        else:
            text = f"{len(self.problems)} problems in the config:\n" + "\n".join(f"  - {m}" for _, m in self.problems)
        super().__init__(text)

    @property
    def keys(self) -> List[str]:
        return [k for k, _ in self.problems]


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


# ----------------------------------------------------------------------------------- validators


def _bool(value: Any, key: str) -> bool:
    if type(value) is not bool:
        raise ValueError(f"{key} must be true or false, got {_show(value)}")
    return value


def _integer(minimum: int) -> Check:
    what = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")

    def check(value: Any, key: str) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} must be {what}, got {_show(value)}")
        if isinstance(value, float):
            if not value.is_integer():
                raise ValueError(f"{key} must be {what}, got {value!r}")
            value = int(value)
        if value < minimum:
            raise ValueError(f"{key} must be {what}, got {value!r}")
        return value

    return check


def _number(low: float, high: float = math.inf, low_open: bool = False) -> Check:
    what = f"a number in ({low}, {high}]" if low_open else f"a number >= {low}"
    if not low_open and high != math.inf:
        what = f"a number in [{low}, {high}]"

    def check(value: Any, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} must be {what}, got {_show(value)}")
        value = float(value)
        if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
            raise ValueError(f"{key} must be {what}, got {value!r}")
        return value

    return check


def _optional(check: Check) -> Check:
    return lambda value, key: None if value is None else check(value, key)


def _string(value: Any, key: str) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string or null, got {_show(value)}")
    return value


def _choice(*choices: str) -> Check:
    def check(value: Any, key: str) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{key} must be one of {', '.join(map(repr, choices))}, got {_show(value)}")
        return value

    return check


def _off_only(feature: str) -> Check:
    """A DeepSpeed switch for a feature deepcompile lacks: only ``false`` is accepted."""

    def check(value: Any, key: str) -> bool:
        if _bool(value, key):
            raise ValueError(f"{key}: {feature} is not supported yet; set it to false or remove it")
        return False

    return check


def _only(expected: Any, why: str) -> Check:
    """A key without effect by design: accepted only with the value that describes the runtime.

    ``why`` says what the runtime does instead; it ends the error message of any other value.
    """
    if isinstance(expected, bool):
        base: Check = _bool
    elif isinstance(expected, int):
        base = _integer(-(2**63))
    else:
        base = _number(-math.inf)

    def check(value: Any, key: str) -> Any:
        value = base(value, key)
        if value != expected:
            raise ValueError(f"{key}={json.dumps(value)} is not supported: {why}. Only {json.dumps(expected)} "
                             "(or leaving the key out) is accepted")
        return value

    return check


def _stage(value: Any, key: str) -> int:
    if value is None:
        raise ValueError(f"{key} is required (1, 2 or 3)")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be 1, 2 or 3, got {_show(value)}")
    if value == 0:
        raise ValueError(f"{key}: stage 0 is not supported; deepcompile needs ZeRO stage 1, 2 or 3")
    if value not in (1, 2, 3):
        raise ValueError(f"{key} must be 1, 2 or 3, got {value!r}")
    return value


def _schedule(value: Any, key: str):
    """A list of {"step": int >= 0, "passes": [names]}; normalized to a tuple of dicts."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{key} must be a list of {{\"step\": ..., \"passes\": [...]}} objects or null, got {_show(value)}")
    entries, steps = [], set()
    for i, entry in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where} must be an object with keys step and passes, got {_show(entry)}")
        _check_keys(entry, ("step", "passes"), where)
        if "step" not in entry or "passes" not in entry:
            raise ValueError(f"{where} needs both 'step' and 'passes'")
        step = _integer(0)(entry["step"], f"{where}.step")
        if step in steps:
            raise ValueError(f"{where}.step: step {step} appears twice")
        steps.add(step)
        passes = entry["passes"]
        if not isinstance(passes, (list, tuple)) or not all(isinstance(p, str) for p in passes):
            raise ValueError(f"{where}.passes must be a list of pass names, got {_show(passes)}")
        unknown = [p for p in passes if p not in PASS_NAMES]
        if unknown:
            raise ValueError(f"{where}.passes: unknown pass {unknown[0]!r}; accepted: {', '.join(PASS_NAMES)}")
        entries.append({"step": step, "passes": tuple(dict.fromkeys(passes))})
    return tuple(entries)


def _fp16_enabled(value: Any, key: str) -> bool:
    if _bool(value, key):
        raise ValueError(f"{key}: fp16 is not supported; use bf16 (\"bf16\": {{\"enabled\": true}})")
    return False


def _communication_data_type(value: Any, key: str) -> Optional[str]:
    if value is None:
        return None
    if value == "fp16":
        raise ValueError(f"{key}=\"fp16\" is not supported: fp16 training is not, and an fp16 reduce of bf16/fp32 "
                         "gradients can overflow without loss scaling; use \"bf16\" or \"fp32\"")
    return _choice("fp32", "bf16")(value, key)


# DeepSpeed's keys of offload_param / offload_optimizer. With device "none" the others are inert.
_OFFLOAD_KEYS = {
    "offload_param": ("device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"),
    "offload_optimizer": ("device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read",
                          "pipeline_write", "fast_init", "ratio"),
}


@dataclasses.dataclass(frozen=True)
class OffloadParam:
    """``zero_optimization.offload_param`` with ``device: "cpu"``: ZeRO-3 parameter offload."""

    device: str = "cpu"
    pin_memory: bool = False  # DeepSpeed's default


# Keys of offload_param that only NVMe offload reads (validated, no effect with device "cpu").
_PARAM_NVME_ONLY = {"nvme_path": lambda v, k: _optional(_string)(v, k), "buffer_count": _integer(1),
                    "buffer_size": _integer(1), "max_in_cpu": _integer(0)}


def _offload_param(value: Any, key: str) -> Optional[OffloadParam]:
    """Absent, null or ``device: "none"``: None. ``device: "cpu"``: the ZeRO-3 parameter shards
    live in host memory (deepcompile/offload/). ``"nvme"``: refused until implemented."""
    if value is None or isinstance(value, OffloadParam):  # already checked (dataclasses.replace re-checks)
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} must be an object or null, got {_show(value)}")
    _check_keys(value, _OFFLOAD_KEYS["offload_param"], key)
    device = value.get("device", "none")
    if device is None or device == "none":
        return None
    if device == "nvme":
        raise ConfigError([(f"{key}.device", f"{key}.device is 'nvme': NVMe parameter offload is not implemented; "
                                              "use \"cpu\" (host memory) or \"none\"")])
    if device != "cpu":
        raise ConfigError([(f"{key}.device", f"{key}.device must be \"none\", \"cpu\" or \"nvme\", got {_show(device)}")])
    for name, check in _PARAM_NVME_ONLY.items():
        if name in value:
            check(value[name], f"{key}.{name}")
    return OffloadParam(device="cpu", pin_memory=_bool(value.get("pin_memory", False), f"{key}.pin_memory"))


_PARAM_OFFLOAD_STAGE = ("parameter offload applies to ZeRO-3's partitioned parameters; under ZeRO-{stage} every "
                        "rank holds whole parameters. Use stage 3, or offload_optimizer / compile.offload_opt_states "
                        "for the optimizer state and master partitions")


@dataclasses.dataclass(frozen=True)
class OffloadOptimizer:
    """``zero_optimization.offload_optimizer`` with ``device: "cpu"`` (deepcompile/offload/)."""

    device: str = "cpu"
    pin_memory: bool = False  # DeepSpeed's default
    # The least fraction of the offloadable optimizer-state bytes kept on the host (DeepSpeed's
    # "ratio", default 1.0: all of it); the memory budget may require more.
    ratio: float = 1.0


# Keys of offload_optimizer that only NVMe offload reads (validated, no effect with device "cpu").
_NVME_ONLY = {"nvme_path": lambda v, k: _optional(_string)(v, k), "buffer_count": _integer(1),
              "pipeline_read": _bool, "pipeline_write": _bool, "fast_init": _bool}


def _offload_optimizer(value: Any, key: str) -> Optional[OffloadOptimizer]:
    """Absent, null or ``device: "none"``: None. ``device: "cpu"``: optimizer-state offload to
    host memory. ``"nvme"``: refused until implemented."""
    if value is None or isinstance(value, OffloadOptimizer):  # already checked (dataclasses.replace re-checks)
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} must be an object or null, got {_show(value)}")
    _check_keys(value, _OFFLOAD_KEYS["offload_optimizer"], key)
    device = value.get("device", "none")
    if device is None or device == "none":
        return None
    if device == "nvme":
        raise ConfigError([(f"{key}.device", f"{key}.device is 'nvme': NVMe offload is not implemented; use "
                                              "\"cpu\" (host memory) or \"none\"")])
    if device != "cpu":
        raise ConfigError([(f"{key}.device", f"{key}.device must be \"none\", \"cpu\" or \"nvme\", got {_show(device)}")])
    for name, check in _NVME_ONLY.items():
        if name in value:
            check(value[name], f"{key}.{name}")
    return OffloadOptimizer(device="cpu", pin_memory=_bool(value.get("pin_memory", False), f"{key}.pin_memory"),
                            ratio=_number(0.0, 1.0, low_open=True)(value.get("ratio", 1.0), f"{key}.ratio"))


def _section(cls: type) -> Check:
    def check(value: Any, key: str):
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"{key} must be an object, got {_show(value)}")
        return cls.from_dict(value)

    return check


def _key(check: Check, default: Any = dataclasses.MISSING, doc: str = "", factory: Any = dataclasses.MISSING,
         auto: Optional[str] = None, no_auto: Optional[str] = None):
    """A config key: its validator, default and documentation.

    ``auto``: how an ``"auto"`` value is derived (the value is kept as ``"auto"`` until
    :meth:`Config.resolve` replaces it); None: ``"auto"`` is an error, explained by ``no_auto``.
    """
    return dataclasses.field(default=default, default_factory=factory,
                             metadata={"check": check, "doc": doc, "auto": auto, "no_auto": no_auto})


def _check_keys(d: Mapping, supported, path: str) -> None:
    for k in d:
        if k not in supported:
            raise ValueError(_unknown_key(k, supported, path))


def _unknown_key(k: Any, supported, path: str) -> str:
    name = f"{path}.{k}" if path else str(k)
    where = f"{path}" if path else "the top level"
    hint = difflib.get_close_matches(str(k), list(supported), n=1)
    hint = f" (did you mean {hint[0]!r}?)" if hint else ""
    return f"unknown config key {name!r}{hint}; supported keys of {where}: {', '.join(supported)}"


# ----------------------------------------------------------------------------------- sections


class _Section:
    _path = ""  # dotted path of the section in the JSON config; "" for the top level
    _aliases: Dict[str, str] = {}  # DeepSpeed's alternative spellings: alias -> key

    def __post_init__(self) -> None:
        problems: List[Tuple[str, str]] = []
        for f in dataclasses.fields(self):
            key = self._dotted(f.name)
            value = getattr(self, f.name)
            if _is_auto(value) and f.metadata["auto"] is None:
                why = f.metadata["no_auto"] or "nothing in the model or the world size determines it"
                problems.append((key, f"{key} is \"auto\", which deepcompile cannot derive ({why}); set a value"))
                continue
            if _is_auto(value):
                continue  # kept as "auto" until Config.resolve
            try:
                object.__setattr__(self, f.name, f.metadata["check"](value, key))
            except ConfigError as e:
                problems.extend(e.problems)
            except ValueError as e:
                problems.append((key, str(e)))
        failed = {k for k, _ in problems}
        problems.extend(self._check_together(lambda name: self._dotted(name) not in failed))
        if problems:
            raise ConfigError(problems)

    def _dotted(self, name: str) -> str:
        return f"{self._path}.{name}" if self._path else name

    def _check_together(self, valid: Callable[[str], bool]) -> List[Tuple[str, str]]:
        """Checks that involve several keys of the section; ``valid(name)``: that key passed its own check."""
        return []

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        if not isinstance(d, Mapping):
            raise TypeError(f"{cls.__name__}.from_dict expects a mapping, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        problems: List[Tuple[str, str]] = []
        kwargs: Dict[str, Any] = {}
        for k, v in d.items():
            target = cls._aliases.get(k, k) if isinstance(k, str) else k
            where = f"{cls._path}.{k}" if cls._path else str(k)
            if target not in names:
                problems.append((where, _unknown_key(k, names, cls._path)))
            elif target in kwargs:
                problems.append((where, f"{where} and its alias {cls._path + '.' if cls._path else ''}{target} are "
                                        "both given; keep one"))
            else:
                kwargs[target] = v
        try:
            obj = cls(**kwargs)
        except ConfigError as e:
            problems.extend(e.problems)
        if problems:
            raise ConfigError(problems)
        return obj

    def to_dict(self) -> Dict[str, Any]:
        return {
            f.name: v.to_dict() if isinstance(v, _Section) else v
            for f in dataclasses.fields(self)
            for v in (getattr(self, f.name),)
        }


# ---- precision


@dataclasses.dataclass(frozen=True)
class Bf16Config(_Section):
    _path = "bf16"
    enabled: bool = _key(_bool, False, "Train in bfloat16: at initialize the model's floating-point parameters are "
                         "cast to bf16 (buffers keep their dtype, as DeepSpeed does), the optimizer updates fp32 "
                         "master weights. false: the model trains in the dtype it has.",
                         auto="true when the model's floating-point parameters are bf16")
    bf16_master_weights_and_grads: bool = _key(
        _only(False, "master weights and gradient partitions are always fp32"), False,
        "Only false: master weights and gradient partitions are fp32.")


_FP16_INERT = "Belongs to fp16 loss scaling; fp16 is never enabled here, so it has no effect (validated only)."


@dataclasses.dataclass(frozen=True)
class Fp16Config(_Section):
    _path = "fp16"
    enabled: bool = _key(_fp16_enabled, False, "Only false is accepted: fp16 is not supported; use bf16.",
                         auto="true when the model's floating-point parameters are fp16, which is then refused")
    auto_cast: bool = _key(_bool, False, _FP16_INERT)
    loss_scale: float = _key(_number(0.0), 0.0, _FP16_INERT)
    initial_scale_power: int = _key(_integer(0), 16, _FP16_INERT)
    loss_scale_window: int = _key(_integer(1), 1000, _FP16_INERT)
    hysteresis: int = _key(_integer(1), 2, _FP16_INERT)
    consecutive_hysteresis: bool = _key(_bool, False, _FP16_INERT)
    min_loss_scale: float = _key(_number(0.0), 1.0, _FP16_INERT)
    fp16_master_weights_and_grads: bool = _key(
        _only(False, "master weights and gradient partitions are always fp32"), False, "Only false.")


# ---- ZeRO

_OVERLAP = "communication always runs on dedicated streams, overlapping compute; to use less bucket memory lower " \
           "reduce_bucket_size or set compile.double_buffer to false"
_CONTIGUOUS = "gradients are always copied into contiguous reduce buckets as they are produced"
_RS = "ZeRO-1/2 gradients are always reduced to the ranks owning their partition (a reduce per owned range), " \
      "never all-reduced"
_AG_PARTITIONS = "after the optimizer step the updated partitions are always all-gathered " \
                 "(in chunks of allgather_bucket_size elements)"
_RR = "round-robin gradient partitioning parallelises gradient copies to the CPU for DeepSpeed's CPU-side " \
      "optimizer step; deepcompile's offload_optimizer steps on the device and copies no gradient to the host"
_MEL = "DeepSpeed's memory-efficient linear autograd function is not implemented; the ZeRO-3 graph pass " \
       "gathers weights for the backward itself"
_LIMIT = ("accepted when it cannot bind for the model (at least {what}); deepcompile decides what stays gathered "
          "with its profile-guided planner under compile.memory_budget_bytes / memory_budget_fraction, not by a "
          "parameter count, so a binding value is refused at initialize")

# Keys of one ZeRO stage are inert under the others (validated only), as fp16's loss-scaling keys
# are while fp16 is off: one config serves every stage by changing "stage" alone, as in DeepSpeed.

_HIDDEN = " \"auto\": {}, where hidden_size is model.config.hidden_size (else this key's default)."


@dataclasses.dataclass(frozen=True)
class ZeroConfig(_Section):
    _path = "zero_optimization"
    _aliases = {"stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save"}

    stage: int = _key(_stage, None, "ZeRO stage: 1, 2 or 3. Required (DeepSpeed's default 0 is unsupported).")
    reduce_bucket_size: int = _key(_integer(1), 500_000_000, "Elements per gradient reduce bucket."
                                   + _HIDDEN.format("hidden_size ** 2"), auto="hidden_size ** 2")
    allgather_bucket_size: int = _key(
        _integer(1), 500_000_000,
        "ZeRO-1/2: elements all-gathered per collective when the updated partitions are gathered after the "
        "optimizer step. Inert under ZeRO-3, which gathers by stage3_prefetch_bucket_size (as DeepSpeed).")
    allgather_partitions: bool = _key(_only(True, _AG_PARTITIONS), True, "Only true: " + _AG_PARTITIONS + ".")
    reduce_scatter: bool = _key(_only(True, _RS), True, "Only true: " + _RS + ".")
    overlap_comm: bool = _key(_only(True, _OVERLAP), True, "Only true: " + _OVERLAP + ".")
    contiguous_gradients: bool = _key(_only(True, _CONTIGUOUS), True, "Only true: " + _CONTIGUOUS + ".")
    round_robin_gradients: bool = _key(_only(False, _RR), False, "Only false: " + _RR + ".")
    stage3_param_persistence_threshold: int = _key(
        _integer(0), 100_000, "ZeRO-3 (inert under ZeRO-1/2): parameters with at most this many elements stay "
        "gathered."
        + _HIDDEN.format("10 * hidden_size"), auto="10 * hidden_size")
    stage3_prefetch_bucket_size: int = _key(
        _integer(0), 50_000_000, "ZeRO-3 (inert under ZeRO-1/2): elements per fused prefetch group (0: one "
        "parameter per group)."
        + _HIDDEN.format("int(0.9 * hidden_size ** 2)"), auto="int(0.9 * hidden_size ** 2)")
    stage3_max_live_parameters: Optional[int] = _key(
        _optional(_integer(0)), None, "ZeRO-3 (inert under ZeRO-1/2): "
        + _LIMIT.format(what="the model's parameter count") + ".")
    stage3_max_reuse_distance: Optional[int] = _key(
        _optional(_integer(0)), None, "ZeRO-3 (inert under ZeRO-1/2): "
        + _LIMIT.format(what="the model's parameter count") + ".")
    stage3_gather_16bit_weights_on_model_save: Any = _key(
        _bool, False, "ZeRO-3: no effect by design, any value: no model-save path skips "
        "consolidation; engine.save_hf() and engine.full_state_dict() gather the full weights (to rank 0, in the "
        "parameters' dtype) whenever they are called.", auto="kept: the key has no effect either way")
    sub_group_size: Optional[int] = _key(
        _optional(_integer(1)), None,
        "ZeRO-3 (inert under ZeRO-1/2, as in DeepSpeed, whose ZeRO-1/2 step their flat partitions whole): the "
        "optimizer step updates at most this many master elements at a time, dropping each sub-group's gradients "
        "after it (lower step peak), and optimizer-state offload streams the step per sub-group. Null: DeepSpeed's "
        "default, 1e9 elements.")
    offload_param: Optional[OffloadParam] = _key(
        _offload_param, None, "ZeRO-3 parameter offload: {\"device\": \"cpu\", \"pin_memory\": bool (default false)} "
        "keeps every rank's parameter shards (the fp32 masters) in host memory between steps; gathers read them from "
        "there. \"none\"/null: off; \"nvme\": refused; stages 1 and 2: refused.")
    offload_optimizer: Optional[OffloadOptimizer] = _key(
        _offload_optimizer, None, "Optimizer-state offload to host memory: {\"device\": \"cpu\", \"pin_memory\": "
        "bool, \"ratio\": least fraction offloaded (default 1.0)}; \"none\"/null: off; \"nvme\": refused. All stages.")
    cpu_offload: bool = _key(_off_only("ZeRO-Offload (the deprecated cpu_offload switch)"), False,
                             "Deprecated DeepSpeed switch for offload_optimizer to the CPU: only false.")
    memory_efficient_linear: bool = _key(_only(False, _MEL), False, "Only false: " + _MEL + ".")

    def _check_together(self, valid: Callable[[str], bool]) -> List[Tuple[str, str]]:
        if valid("stage") and valid("offload_param") and self.offload_param is not None and self.stage != 3:
            key = self._dotted("offload_param")
            return [(key, f"{key}: " + _PARAM_OFFLOAD_STAGE.format(stage=self.stage))]
        return []


# ---- deepcompile


@dataclasses.dataclass(frozen=True)
class CompileConfig(_Section):
    _path = "compile"
    deepcompile: bool = _key(_bool, True, "Compile through deepcompile's passes when engine.compile() is "
                             "called (DeepSpeed's default is false; here it is true).")
    free_activation: bool = _key(_bool, False, "Free saved activations in the backward right after their last use "
                                 "(compiled graphs, every backend and stage).")
    free_activation_threshold: int = _key(_integer(0), 10 * 1024 * 1024,
                                          "Bytes; free_activation frees tensors larger than this.")
    offload_activation: bool = _key(_bool, False, "Copy saved activations to host memory in the forward and reload "
                                    "them ahead of their use in the backward, as far as the memory budget requires "
                                    "(compiled graphs).")
    offload_activation_pin_memory: bool = _key(_bool, True, "Pinned host buffers for offload_activation (CUDA).")
    offload_opt_states: bool = _key(_bool, False, "Keep the optimizer state (and ZeRO-1/2 fp32 master partitions) in "
                                    "pinned host memory as far as the memory budget requires; reloaded for the step.")
    offload_parameters: bool = _key(_bool, False, "ZeRO-3 only: the parameter shards (the fp32 masters) may live in "
                                    "pinned host memory between steps, as far as the memory budget requires after the "
                                    "optimizer state; gathers read them from there. Stages 1 and 2: refused.")
    symmetric_memory: bool = _key(_off_only("symmetric memory"), False, "Only false is accepted.")
    double_buffer: bool = _key(_bool, True, "Double-buffered gradient reduce buckets.")
    debug_log: bool = _key(_bool, False, "Rank-0 graph and timing logs.")
    debug_checks: bool = _key(_bool, False, "Verify while training that no parameter placeholder reaches a "
                              "computation and that every gradient is reduced exactly as often as it is "
                              "produced (deepcompile/debug_checks.py); raises DebugCheckError otherwise.")
    optimizer_step_in_backward: bool = _key(
        _bool, False, "ZeRO-3: step each parameter during the backward of a window's last micro-step, as soon as its "
        "gradient is final, and free its gradient partition then (deepcompile/zero/backward_step.py); with "
        "engine.compile(regional=True) a backward holds about one layer's gradients at a time. Needs no "
        "gradient_clipping and no optimizer-state or parameter offload.")
    report_dir: Optional[str] = _key(_optional(_string), None, "Directory for graph/profile reports, or null.")
    sync_before_reduce: bool = _key(_bool, False, "Debug: device sync before each reduce.")
    sync_after_reduce: bool = _key(_bool, False, "Debug: device sync after each reduce.")
    sync_before_allgather: bool = _key(_bool, False, "Debug: device sync before each all-gather.")
    sync_after_allgather: bool = _key(_bool, False, "Debug: device sync after each all-gather.")
    keep_int_input_tensors: bool = _key(_bool, True, "Profiling keeps real values of int/bool graph inputs.")
    keep_all_input_tensors: bool = _key(_bool, False, "Profiling keeps real values of all graph inputs.")
    # deepcompile's own scheduling keys (not in DeepSpeed)
    warmup_steps: int = _key(_integer(0), 5, "ZeRO-3: optimizer step from which prefetch and selective_gather apply "
                             "(profiled in the step before).")
    prefetch: bool = _key(_bool, True, "ZeRO-3: after warm-up, launch fused all-gathers ahead of their use, "
                          "planned from a profile within the memory budget.")
    selective_gather: bool = _key(_bool, True, "ZeRO-3: after warm-up, keep the parameters whose re-gathering "
                                  "costs most gathered, within the memory budget.")
    schedule: Optional[tuple] = _key(_schedule, None, "ZeRO-3: explicit pass schedule replacing the one built from "
                                     "warmup_steps/prefetch/selective_gather: a list of {\"step\": int, "
                                     "\"passes\": [\"prefetch\" | \"selective_gather\", ...]}.")
    verify_plan: bool = _key(_bool, False, "ZeRO-3: run the first micro-step under a new plan through the "
                             "profiler once more (interpreted, un-fused), to measure each graph's peak for the "
                             "schedule report. Off: the report says 'not measured' and the planned graphs run "
                             "compiled from that step on.")
    memory_budget_fraction: float = _key(_number(0.0, 1.0, low_open=True), 0.9,
                                         "Fraction of device memory the profile-guided passes may plan for.")
    memory_budget_bytes: Optional[int] = _key(_optional(_integer(1)), None,
                                              "Bytes the profile-guided passes may plan for; overrides "
                                              "memory_budget_fraction when set.")


# ---- optimizer and scheduler

_HF_FILLS = "HF Trainer replaces it with TrainingArguments.{} before handing the config over"


def _betas(value: Any, key: str) -> Tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"{key} must be a list of two numbers in [0, 1), got {_show(value)}")
    return tuple(_number(0.0, 1.0)(b, f"{key}[{i}]") for i, b in enumerate(value))  # type: ignore[return-value]


def _lrs(value: Any, key: str):
    """A learning rate, or a list of them (one per optimizer param group), as DeepSpeed's schedulers take."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{key} must be a number or a non-empty list of numbers")
        return tuple(_number(0.0)(v, f"{key}[{i}]") for i, v in enumerate(value))
    return _number(0.0)(value, key)


class _Param:
    """One key of optimizer.params / scheduler.params: validator, default, "auto" handling."""

    REQUIRED = object()

    def __init__(self, check: Check, default: Any, doc: str, auto: Any = None, no_auto: Optional[str] = None):
        self.check, self.default, self.doc, self.auto, self.no_auto = check, default, doc, auto, no_auto


_ADAM_BIAS = "torch's Adam/AdamW always correct the moment estimates' bias"
_ADAM_PARAMS = {
    "lr": _Param(_number(0.0), 1e-3, "Learning rate.", no_auto=_HF_FILLS.format("learning_rate")),
    "betas": _Param(_betas, (0.9, 0.999), "Moment decay rates.", no_auto=_HF_FILLS.format("adam_beta1/adam_beta2")),
    "eps": _Param(_number(0.0), 1e-8, "Denominator term.", no_auto=_HF_FILLS.format("adam_epsilon")),
    "weight_decay": _Param(_number(0.0), 0.0, "Weight decay (DeepSpeed's default 0, not torch's 0.01).",
                           no_auto=_HF_FILLS.format("weight_decay")),
    "adam_w_mode": _Param(_bool, True, "Adam only: true (DeepSpeed's default) = decoupled weight decay, i.e. "
                                       "torch.optim.AdamW; false = L2 penalty added to the gradient, "
                                       "torch.optim.Adam."),
    "bias_correction": _Param(_only(True, _ADAM_BIAS), True, "Only true: " + _ADAM_BIAS + "."),
    "amsgrad": _Param(_bool, False, "AMSGrad variant (torch's implementation)."),
    "torch_adam": _Param(_bool, False, "Any value: the update is always torch.optim's Adam/AdamW, which computes what "
                                       "DeepSpeed's FusedAdam (torch_adam false) computes."),
}
_SGD_PARAMS = {
    "lr": _Param(_number(0.0), 1e-3, "Learning rate.", no_auto=_HF_FILLS.format("learning_rate")),
    "momentum": _Param(_number(0.0), 0.0, "Momentum factor."),
    "dampening": _Param(_number(0.0), 0.0, "Momentum dampening."),
    "weight_decay": _Param(_number(0.0), 0.0, "L2 penalty.", no_auto=_HF_FILLS.format("weight_decay")),
    "nesterov": _Param(_bool, False, "Nesterov momentum."),
}
# Canonical type name -> accepted params. DeepSpeed matches its optimizer names case-insensitively.
OPTIMIZER_TYPES: Dict[str, Dict[str, _Param]] = {"Adam": _ADAM_PARAMS, "AdamW": _ADAM_PARAMS, "SGD": _SGD_PARAMS}

_STEPS_NO_AUTO = "it is the training length, which HF Trainer computes from the data and epochs before handing " \
                 "the config over"
_WARMUP_NO_AUTO = "HF Trainer fills it from TrainingArguments.warmup_steps / warmup_ratio"
_WARMUP_COMMON = {
    "warmup_num_steps": _Param(_integer(1), 1000, "Warm-up length in optimizer steps (values below 2 act as 2, as "
                                                  "in DeepSpeed).", no_auto=_WARMUP_NO_AUTO),
    "warmup_type": _Param(_choice("log", "linear"), "log", "Shape of the warm-up: \"log\" or \"linear\"."),
    "last_batch_iteration": _Param(
        _only(-1, "a schedule always starts at the first step here (there is no checkpoint to resume from)"), -1,
        "Only -1."),
}
_WARMUP_LR = {
    "warmup_min_lr": _Param(_lrs, 0.0, "Learning rate at the start of the warm-up (a number, or one per param "
                                       "group).", auto=0.0),
    "warmup_max_lr": _Param(_optional(_lrs), None, "Learning rate after the warm-up; default: the optimizer's "
                                                   "learning rate per param group.", auto=AUTO),
    **_WARMUP_COMMON,
}
_TOTAL = _Param(_integer(1), _Param.REQUIRED, "Total number of optimizer steps of the schedule.",
                no_auto=_STEPS_NO_AUTO)
SCHEDULER_TYPES: Dict[str, Dict[str, _Param]] = {
    "WarmupLR": _WARMUP_LR,
    "WarmupDecayLR": {**_WARMUP_LR,
                      "warmup_max_lr": _Param(_lrs, 1e-3, "Learning rate after the warm-up (DeepSpeed's default "
                                                          "0.001).", auto=AUTO),
                      "total_num_steps": _TOTAL},
    "WarmupCosineLR": {
        "total_num_steps": _TOTAL,
        "warmup_min_ratio": _Param(_number(0.0, 1.0), 0.0, "Start of the warm-up as a fraction of the optimizer's "
                                                            "learning rate."),
        "cos_min_ratio": _Param(_number(0.0, 1.0), 1e-4, "End of the cosine decay as a fraction of the optimizer's "
                                                         "learning rate."),
        **_WARMUP_COMMON,
    },
}


def _check_params(spec: Dict[str, _Param], params: Any, path: str, kind: str, type_name: str):
    """Validate ``params`` against ``spec``; returns (normalized items with defaults filled, problems)."""
    problems: List[Tuple[str, str]] = []
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        return (), [(path, f"{path} must be an object, got {_show(params)}")]
    out: Dict[str, Any] = {}
    for k, v in params.items():
        key = f"{path}.{k}"
        if kind == "optimizer" and k == "max_grad_norm":
            problems.append((key, f"{key} is not an optimizer parameter: use the top-level gradient_clipping"))
            continue
        if k not in spec:
            problems.append((key, f"unknown config key {key!r} for {kind} {type_name}; supported: "
                                  f"{', '.join(spec)}"))
            continue
        p = spec[k]
        if _is_auto(v):
            if p.auto is None:
                problems.append((key, f"{key} is \"auto\", which deepcompile cannot derive "
                                      f"({p.no_auto or 'it has no derivation here'}); set a value"))
            else:
                out[k] = p.auto
            continue
        try:
            out[k] = p.check(v, key)
        except ValueError as e:
            problems.append((key, str(e)))
    for k, p in spec.items():
        if k not in out and k not in params:
            if p.default is _Param.REQUIRED:
                problems.append((f"{path}.{k}", f"{path}.{k} is required for {kind} {type_name}"))
            else:
                out[k] = p.default
    return tuple(sorted(out.items())), problems


def _type_name(choices: Sequence[str], case_insensitive: bool) -> Check:
    def check(value: Any, key: str) -> str:
        if value is None:
            raise ValueError(f"{key} is required: one of {', '.join(choices)}")
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {_show(value)}")
        for c in choices:
            if value == c or (case_insensitive and value.lower() == c.lower()):
                return c
        hint = difflib.get_close_matches(value, list(choices), n=1)
        hint = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ValueError(f"{key}={value!r} is not supported{hint}: deepcompile builds {', '.join(choices)}; for "
                         "another one pass it to deepcompile.initialize instead of the config section")
    return check


def _params_field(value: Any, key: str):
    # Normalized against the type in _check_together; here only the container is kept hashable.
    if isinstance(value, tuple):
        return value
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} must be an object, got {_show(value)}")
    return ("__raw__", tuple(value.items()))


def _normalize_params(section, spec_of: Dict[str, Dict[str, _Param]], kind: str) -> List[Tuple[str, str]]:
    raw = section.params
    if raw and raw[0] == "__raw__":
        params = dict(raw[1])
    else:
        params = dict(raw)
    items, problems = _check_params(spec_of[section.type], params, section._dotted("params"), kind, section.type)
    object.__setattr__(section, "params", items)
    return problems


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(_Section):
    """``optimizer``: built by deepcompile when ``initialize`` gets no optimizer object."""

    _path = "optimizer"
    type: str = _key(_type_name(tuple(OPTIMIZER_TYPES), True), None,
                     "Adam, AdamW or SGD (any case). Adam honours adam_w_mode (default true: AdamW's update).")
    params: tuple = _key(_params_field, (), "The optimizer's hyper-parameters; defaults filled in.")
    legacy_fusion: bool = _key(_only(False, "it selects DeepSpeed's legacy fused fp16 optimizer; fp16 is not "
                                            "supported"), False, "Only false.")

    def _check_together(self, valid: Callable[[str], bool]) -> List[Tuple[str, str]]:
        if not (valid("type") and valid("params")):
            return []
        problems = _normalize_params(self, OPTIMIZER_TYPES, "optimizer")
        if not problems and self.type == "AdamW" and not self.params_dict()["adam_w_mode"]:
            key = self._dotted("params.adam_w_mode")
            problems.append((key, f"{key}=false contradicts type AdamW (decoupled weight decay); use type Adam "
                                  "for the L2 form"))
        return problems

    def params_dict(self) -> Dict[str, Any]:
        return dict(self.params)

    def to_dict(self) -> Dict[str, Any]:
        params = {k: list(v) if isinstance(v, tuple) else v for k, v in self.params}
        return {"type": self.type, "params": params, "legacy_fusion": self.legacy_fusion}


@dataclasses.dataclass(frozen=True)
class SchedulerConfig(_Section):
    """``scheduler``: a learning-rate schedule stepped once per optimizer step."""

    _path = "scheduler"
    type: str = _key(_type_name(tuple(SCHEDULER_TYPES), False), None,
                     "WarmupLR, WarmupDecayLR or WarmupCosineLR, with DeepSpeed's meaning (docs/config.md).")
    params: tuple = _key(_params_field, (), "The schedule's parameters; defaults filled in.")

    def _check_together(self, valid: Callable[[str], bool]) -> List[Tuple[str, str]]:
        if not (valid("type") and valid("params")):
            return []
        return _normalize_params(self, SCHEDULER_TYPES, "scheduler")

    def params_dict(self) -> Dict[str, Any]:
        return dict(self.params)

    def to_dict(self) -> Dict[str, Any]:
        params = {k: list(v) if isinstance(v, tuple) else v for k, v in self.params}
        return {"type": self.type, "params": params}


# ---- other DeepSpeed sections

_ACKPT = "it configures DeepSpeed's activation-checkpointing API (deepspeed.checkpointing), which deepcompile does " \
         "not provide; use torch.utils.checkpoint (e.g. a Hugging Face model's gradient_checkpointing_enable())"


@dataclasses.dataclass(frozen=True)
class ActivationCheckpointingConfig(_Section):
    _path = "activation_checkpointing"
    partition_activations: bool = _key(_only(False, _ACKPT), False, "Only false: " + _ACKPT + ".")
    cpu_checkpointing: bool = _key(_only(False, _ACKPT), False, "Only false.")
    contiguous_memory_optimization: bool = _key(_only(False, _ACKPT), False, "Only false.")
    number_checkpoints: Optional[int] = _key(_optional(_integer(1)), None,
                                             "Buffer count of contiguous_memory_optimization (which is off): no "
                                             "effect, validated only.")
    synchronize_checkpoint_boundary: bool = _key(_only(False, _ACKPT), False, "Only false.")
    profile: bool = _key(_only(False, _ACKPT), False, "Only false.")


_MONITOR = "monitoring backends are not implemented; log engine.get_lr() and the loss yourself"


@dataclasses.dataclass(frozen=True)
class TensorboardConfig(_Section):
    _path = "tensorboard"
    enabled: bool = _key(_only(False, _MONITOR), False, "Only false: " + _MONITOR + ".")
    output_path: str = _key(_string, "", "Belongs to the disabled monitor: validated only.")
    job_name: str = _key(_string, "DeepSpeedJobName", "Belongs to the disabled monitor: validated only.")


@dataclasses.dataclass(frozen=True)
class CsvMonitorConfig(_Section):
    _path = "csv_monitor"
    enabled: bool = _key(_only(False, _MONITOR), False, "Only false: " + _MONITOR + ".")
    output_path: str = _key(_string, "", "Belongs to the disabled monitor: validated only.")
    job_name: str = _key(_string, "DeepSpeedJobName", "Belongs to the disabled monitor: validated only.")


@dataclasses.dataclass(frozen=True)
class WandbConfig(_Section):
    _path = "wandb"
    enabled: bool = _key(_only(False, _MONITOR), False, "Only false: " + _MONITOR + ".")
    group: Optional[str] = _key(_optional(_string), None, "Belongs to the disabled monitor: validated only.")
    team: Optional[str] = _key(_optional(_string), None, "Belongs to the disabled monitor: validated only.")
    project: str = _key(_string, "deepspeed", "Belongs to the disabled monitor: validated only.")


_HYBRID = "DeepSpeed-Chat's hybrid (training + inference) engine is not implemented"


@dataclasses.dataclass(frozen=True)
class HybridEngineConfig(_Section):
    _path = "hybrid_engine"
    enabled: bool = _key(_only(False, _HYBRID), False, "Only false: " + _HYBRID + ".")
    max_out_tokens: int = _key(_integer(1), 512, "Belongs to the disabled hybrid engine: validated only.")
    inference_tp_size: int = _key(_integer(1), 1, "Belongs to the disabled hybrid engine: validated only.")
    release_inference_cache: bool = _key(_bool, False, "Belongs to the disabled hybrid engine: validated only.")
    pin_parameters: bool = _key(_bool, True, "Belongs to the disabled hybrid engine: validated only.")
    tp_gather_partition_size: int = _key(_integer(1), 8, "Belongs to the disabled hybrid engine: validated only.")


_UNTESTED = "torch.optim.Adam, AdamW and SGD"
_AVERAGE = "the runtime averages gradients inside the collective (NCCL's average op; gloo divides by the world size " \
           "before summing); the split of the division around the sum only matters against fp16 overflow, and fp16 " \
           "is not supported"


@dataclasses.dataclass(frozen=True)
class Config(_Section):
    """The whole configuration. Build it with :meth:`from_any` / :meth:`from_dict`."""

    _aliases = {"bfloat16": "bf16"}

    zero_optimization: ZeroConfig = _key(_section(ZeroConfig), factory=ZeroConfig,
                                         doc="ZeRO settings; 'stage' is required.")
    compile: CompileConfig = _key(_section(CompileConfig), factory=CompileConfig, doc="DeepCompile settings.")
    bf16: Bf16Config = _key(_section(Bf16Config), factory=Bf16Config, doc="bfloat16 training (alias: bfloat16).")
    fp16: Fp16Config = _key(_section(Fp16Config), factory=Fp16Config, doc="Only disabled fp16 is accepted.")
    optimizer: Optional[OptimizerConfig] = _key(
        _optional(_section(OptimizerConfig)), None,
        "The optimizer deepcompile builds when initialize gets none (an optimizer object and this section together "
        "are an error).")
    scheduler: Optional[SchedulerConfig] = _key(
        _optional(_section(SchedulerConfig)), None,
        "The learning-rate schedule, stepped once per optimizer step (a lr_scheduler passed to initialize and this "
        "section together are an error).")
    train_micro_batch_size_per_gpu: Optional[int] = _key(
        _optional(_integer(1)), None, "Micro-batch size per rank: checked against the other batch keys (the engine "
        "does not load data).", auto="train_batch_size / (gradient_accumulation_steps * world_size)")
    train_batch_size: Optional[int] = _key(_optional(_integer(1)), None,
                                           "Global batch size; see check_batch_size().",
                                           auto="train_micro_batch_size_per_gpu * gradient_accumulation_steps * "
                                                "world_size")
    gradient_accumulation_steps: Optional[int] = _key(
        _optional(_integer(1)), None, "Micro-batches per optimizer step. Unset: train_batch_size / (micro * world) "
        "when both are given, else 1 (as DeepSpeed).",
        auto="train_batch_size / (train_micro_batch_size_per_gpu * world_size)")
    gradient_clipping: float = _key(_number(0.0), 0.0, "Max global gradient norm; 0 disables clipping.",
                                    no_auto=_HF_FILLS.format("max_grad_norm"))
    steps_per_print: int = _key(_integer(1), 10, "Every this many optimizer steps rank 0 logs the step and learning "
                                "rates (and, with wall_clock_breakdown, the times) to the 'deepcompile' logger at "
                                "INFO level.")
    wall_clock_breakdown: bool = _key(_bool, False, "Time forward, backward and the optimizer step (synchronizing "
                                      "the device around each) and log the mean per step every steps_per_print "
                                      "steps.")
    communication_data_type: Optional[str] = _key(
        _communication_data_type, None,
        "dtype of gradient reductions: \"fp32\" or \"bf16\" (\"fp16\" is refused). Unset: ZeRO-3 reduces in fp32, "
        "ZeRO-1/2 in the parameters' dtype. ZeRO-3 honours both (\"bf16\" with gradient_accumulation_steps 1 "
        "only); ZeRO-1/2 only the parameters' dtype (docs/config.md says why).")
    prescale_gradients: bool = _key(_only(False, _AVERAGE), False, "Only false: " + _AVERAGE + ".")
    gradient_predivide_factor: float = _key(_only(1.0, _AVERAGE), 1.0, "Only 1.0: " + _AVERAGE + ".")
    zero_allow_untested_optimizer: bool = _key(
        _bool, False, f"false: an optimizer object other than {_UNTESTED} (the ones deepcompile's tests cover) is "
        "refused; true: any torch.optim.Optimizer is accepted.")
    zero_force_ds_cpu_optimizer: bool = _key(
        _bool, True, "No effect by design, any value: with offload_optimizer the optimizer state is reloaded and the "
        "step runs on the device with the user's optimizer; no CPU optimizer is substituted.")
    activation_checkpointing: ActivationCheckpointingConfig = _key(
        _section(ActivationCheckpointingConfig), factory=ActivationCheckpointingConfig,
        doc="DeepSpeed's activation-checkpointing API: only its off settings.")
    tensorboard: TensorboardConfig = _key(_section(TensorboardConfig), factory=TensorboardConfig,
                                          doc="Only disabled.")
    csv_monitor: CsvMonitorConfig = _key(_section(CsvMonitorConfig), factory=CsvMonitorConfig, doc="Only disabled.")
    wandb: WandbConfig = _key(_section(WandbConfig), factory=WandbConfig, doc="Only disabled.")
    hybrid_engine: HybridEngineConfig = _key(_section(HybridEngineConfig), factory=HybridEngineConfig,
                                             doc="Only disabled.")

    def _check_together(self, valid: Callable[[str], bool]) -> List[Tuple[str, str]]:
        # A section that failed its own checks is left as given (not a section object): skip.
        if not (isinstance(self.compile, CompileConfig) and isinstance(self.zero_optimization, ZeroConfig)):
            return []
        problems: List[Tuple[str, str]] = []
        if self.compile.offload_parameters and self.zero_optimization.stage != 3:
            problems.append(("compile.offload_parameters", "compile.offload_parameters: "
                             + _PARAM_OFFLOAD_STAGE.format(stage=self.zero_optimization.stage)))
        if self.compile.optimizer_step_in_backward:
            problems.extend(self._step_in_backward_conflicts(valid))
        return problems

    def _step_in_backward_conflicts(self, valid: Callable[[str], bool]) -> List[Tuple[str, str]]:
        """compile.optimizer_step_in_backward against the keys it cannot work with, and why."""
        key = "compile.optimizer_step_in_backward"
        z = self.zero_optimization
        conflicts = []
        if z.stage != 3:
            conflicts.append(f"zero_optimization.stage is {z.stage}: it is built for ZeRO-3's per-parameter gradient "
                             "partitions (ZeRO-1/2 reduce into flat partitions that span parameters)")
        if valid("gradient_clipping") and not _is_auto(self.gradient_clipping) and self.gradient_clipping > 0:
            conflicts.append(f"gradient_clipping is {self.gradient_clipping}: clipping scales every gradient by the "
                             "global norm, which is known only after the last gradient, too late for a step in the "
                             "backward")
        offloads = [name for name, on in (("compile.offload_opt_states", self.compile.offload_opt_states),
                                          ("compile.offload_parameters", self.compile.offload_parameters),
                                          ("zero_optimization.offload_optimizer", z.offload_optimizer is not None),
                                          ("zero_optimization.offload_param", z.offload_param is not None)) if on]
        if offloads:
            conflicts.append(f"{', '.join(offloads)} on: the offloaded step streams optimizer state and masters "
                             "through host memory sub-group by sub-group after the backward")
        return [(key, f"{key} cannot be used here: {c}; turn it off or change that setting") for c in conflicts]

    def to_dict(self) -> Dict[str, Any]:
        out = super().to_dict()
        for name in ("optimizer", "scheduler"):
            if out[name] is None:
                del out[name]  # absent rather than null: DeepSpeed reads null as a malformed section
        return out

    @classmethod
    def from_any(cls, obj: Any) -> "Config":
        """A :class:`Config` from a Config (returned as is), a dict, or a path to a JSON file."""
        if isinstance(obj, Config):
            return obj
        if isinstance(obj, Mapping):
            return cls.from_dict(obj)
        if isinstance(obj, (str, os.PathLike)):
            path = os.fspath(obj)
            with open(path, encoding="utf-8") as f:
                try:
                    d = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"config file {path}: invalid JSON: {e}") from e
            if not isinstance(d, dict):
                raise ValueError(f"config file {path} must hold a JSON object, got {type(d).__name__}")
            return cls.from_dict(d)
        raise TypeError(
            f"config must be a dict, a path to a JSON file or a deepcompile.Config, got {type(obj).__name__}"
        )

    # ---- batch sizes

    def _batch_sizes(self, world_size: int) -> Dict[str, Optional[int]]:
        """train_batch_size, micro-batch size and accumulation steps, completed as DeepSpeed completes them."""
        world = _integer(1)(world_size, "world_size")
        tbs, micro, gas = self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        autos = [k for k, v in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", micro),
                                ("gradient_accumulation_steps", gas)) if _is_auto(v)]
        if len(autos) > 1:
            raise ConfigError([(k, f"{k} is \"auto\" and so is {' and '.join(a for a in autos if a != k)}: at most "
                                   "one of train_batch_size, train_micro_batch_size_per_gpu and "
                                   "gradient_accumulation_steps can be derived from the others (HF Trainer fills "
                                   "them from per_device_train_batch_size and gradient_accumulation_steps)")
                               for k in autos])
        if autos:
            name = autos[0]
            needs = {"train_batch_size": ("train_micro_batch_size_per_gpu",),
                     "train_micro_batch_size_per_gpu": ("train_batch_size",),
                     "gradient_accumulation_steps": ("train_batch_size", "train_micro_batch_size_per_gpu")}[name]
            missing = [k for k in needs if getattr(self, k) is None]
            if missing:
                raise ConfigError([(name, f"{name} is \"auto\" but {' and '.join(missing)} is not given, so it "
                                          "cannot be derived")])
            if name == "train_batch_size":
                tbs = None
            elif name == "train_micro_batch_size_per_gpu":
                micro = None
            else:
                gas = None
        # DeepSpeed's completion: any two determine the third; one alone implies 1 accumulation step.
        if tbs is not None and micro is not None and gas is not None:
            if tbs != micro * gas * world:
                raise ConfigError([("train_batch_size", (
                    f"train_batch_size ({tbs}) must equal train_micro_batch_size_per_gpu ({micro}) * "
                    f"gradient_accumulation_steps ({gas}) * world size ({world}) = {micro * gas * world}"))])
        elif tbs is not None and micro is not None:
            if tbs % (micro * world):
                raise ConfigError([("train_batch_size", (
                    f"train_batch_size ({tbs}) must be divisible by train_micro_batch_size_per_gpu ({micro}) * "
                    f"world size ({world}) = {micro * world}"))])
            gas = tbs // (micro * world)
        elif tbs is not None:
            gas = gas if gas is not None else 1
            if tbs % (gas * world):
                raise ConfigError([("train_batch_size", (
                    f"train_batch_size ({tbs}) must be divisible by gradient_accumulation_steps ({gas}) * "
                    f"world size ({world}) = {gas * world}"))])
            micro = tbs // (gas * world)
        elif micro is not None:
            gas = gas if gas is not None else 1
            tbs = micro * gas * world
        else:
            gas = gas if gas is not None else 1
        return {"train_batch_size": tbs, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}

    def check_batch_size(self, world_size: int) -> None:
        """Raise ValueError unless the batch sizes agree for ``world_size`` ranks.

        Any two of train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps
        determine the third (``train_batch_size = micro * gas * world``); all three must agree, and
        a derived one must come out whole. Nothing to check when none is given.
        """
        self._batch_sizes(world_size)

    # ---- "auto" and model-dependent checks

    def resolve(self, world_size: int, model: Any = None) -> "Config":
        """This config with every ``"auto"`` it can derive filled in, checked against the model.

        ``model`` supplies the hidden size and parameter dtypes for the derivations (module
        docstring) and the parameter count for the keys accepted only when they cannot bind
        (``stage3_max_live_parameters``, ``stage3_max_reuse_distance``).
        ``communication_data_type`` is checked against the dtype the model will train in. Raises
        :class:`ConfigError` naming every key that cannot be honoured. Idempotent.
        """
        import torch

        problems: List[Tuple[str, str]] = []
        changes: Dict[str, Any] = {}
        try:
            changes.update(self._batch_sizes(world_size))
        except ConfigError as e:
            problems.extend(e.problems)
        gas = changes.get("gradient_accumulation_steps", 1)

        dtypes = _float_param_dtypes(model)
        bf16, fp16 = self.bf16, self.fp16
        for name, section, dtype in (("bf16", bf16, torch.bfloat16), ("fp16", fp16, torch.float16)):
            if not _is_auto(section.enabled):
                continue
            if dtypes is None:
                problems.append((f"{name}.enabled", f"{name}.enabled is \"auto\": it follows the model's parameter "
                                                    "dtype, but no model was given"))
                continue
            try:
                changes[name] = dataclasses.replace(section, enabled=dtype in dtypes)
            except ConfigError as e:
                problems.extend((k, m + f" (\"auto\": the model's parameters are {dtype})") for k, m in e.problems)
        bf16_on = changes.get("bf16", bf16).enabled is True

        z = self.zero_optimization
        hidden = _hidden_size(model)
        zero_changes: Dict[str, Any] = {}
        derive = {"reduce_bucket_size": lambda h: h * h,
                  "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
                  "stage3_param_persistence_threshold": lambda h: 10 * h}
        defaults = {f.name: f.default for f in dataclasses.fields(ZeroConfig)}
        for name, rule in derive.items():
            if _is_auto(getattr(z, name)):
                useful = z.stage == 3 or name == "reduce_bucket_size"
                zero_changes[name] = rule(hidden) if hidden is not None and useful else defaults[name]
        if zero_changes:
            changes["zero_optimization"] = z = dataclasses.replace(z, **zero_changes)

        if model is not None and z.stage == 3:  # stage-3 keys are inert under ZeRO-1/2
            params = {id(p): p for p in model.parameters()}.values()
            total = sum(p.numel() for p in params)
            per_rank = -(-total // world_size)
            for name, bound, what in (("stage3_max_live_parameters", total, "parameters"),
                                      ("stage3_max_reuse_distance", total, "parameters")):
                value = getattr(z, name)
                if value is not None and value < bound:
                    key = f"zero_optimization.{name}"
                    problems.append((key, f"{key}={value} would bind for this model ({bound} {what}), and "
                                          f"deepcompile does not implement it: {_BINDING[name]}"))

        problems.extend(self._check_communication_dtype(model, bf16_on, gas))
        if problems:
            raise ConfigError(problems)
        return dataclasses.replace(self, **changes) if changes else self

    def _check_communication_dtype(self, model: Any, bf16_on: bool, gas: int) -> List[Tuple[str, str]]:
        import torch

        want = self.communication_data_type
        if want is None:
            return []
        key = "communication_data_type"
        if self.zero_optimization.stage == 3:
            if want == "bf16" and gas != 1:
                return [(key, (
                    f"{key}=\"bf16\" with ZeRO-3 needs gradient_accumulation_steps 1 (got {gas}): the runtime "
                    "allocates the gradient partitions in the reduce dtype, so micro-steps would accumulate in bf16. "
                    "Reducing in bf16 into fp32 partitions needs a reduce dtype separate from the partition dtype "
                    "in the C++ GradReducer"))]
            return []
        trained = {torch.bfloat16} if bf16_on else {p.dtype for p in _trainable_float_params(model)}
        wanted = torch.float32 if want == "fp32" else torch.bfloat16
        if not trained or trained == {wanted}:
            return []
        return [(key, (
            f"{key}=\"{want}\" with ZeRO-{self.zero_optimization.stage} is not supported for parameters in "
            f"{', '.join(sorted(str(d) for d in trained))}: ZeRO-1/2 reduce gradients in the parameters' dtype "
            "(register_z12_param takes no reduce dtype; the C++ runtime would need one, as register_z3_params has "
            "with expected_grad_dtypes). Leave it unset or make it match the parameters"))]

    def zero3_reduce_dtype(self):
        """The dtype ZeRO-3 reduces trainable gradients in (and stores their partitions in)."""
        import torch

        return torch.bfloat16 if self.communication_data_type == "bf16" else torch.float32

    def runtime_config(self) -> Dict[str, Any]:
        """Keyword arguments for :class:`deepcompile.runtime.RuntimeConfig`.

        The keys are checked against RuntimeConfig's fields so the two cannot drift apart.
        """
        from deepcompile.runtime import RuntimeConfig  # imports the C++ extension

        c = self.compile
        if _is_auto(self.zero_optimization.reduce_bucket_size):
            raise ValueError("zero_optimization.reduce_bucket_size is still \"auto\": resolve the config "
                             "(Config.resolve) before building the runtime settings")
        kwargs = {
            "reduce_bucket_size": self.zero_optimization.reduce_bucket_size,
            "double_buffer": c.double_buffer,
            "free_activation_threshold": c.free_activation_threshold,
            "sync_before_reduce": c.sync_before_reduce,
            "sync_after_reduce": c.sync_after_reduce,
            "sync_before_allgather": c.sync_before_allgather,
            "sync_after_allgather": c.sync_after_allgather,
        }
        fields = {f.name for f in dataclasses.fields(RuntimeConfig)}
        if fields != set(kwargs):
            drift = sorted(fields ^ set(kwargs))
            raise RuntimeError(f"Config.runtime_config is out of date with RuntimeConfig: {drift}")
        return kwargs


_BINDING = {
    "stage3_max_live_parameters": "what stays gathered is planned under compile.memory_budget_bytes / "
                                  "memory_budget_fraction, not by a parameter count; remove the key and set a "
                                  "memory budget",
    "stage3_max_reuse_distance": "which released parameters stay gathered is planned under "
                                 "compile.memory_budget_bytes / memory_budget_fraction (selective_gather), not by a "
                                 "reuse distance; remove the key and set a memory budget",
}


def _float_param_dtypes(model: Any):
    if model is None:
        return None
    return {p.dtype for p in model.parameters() if p.is_floating_point()}


def _trainable_float_params(model: Any):
    if model is None:
        return []
    return [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]


def _hidden_size(model: Any) -> Optional[int]:
    """``model.config.hidden_size``, or the largest of ``hidden_sizes`` (HF models), else None."""
    cfg = getattr(model, "config", None)
    size = getattr(cfg, "hidden_size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    sizes = getattr(cfg, "hidden_sizes", None)
    if isinstance(sizes, (list, tuple)) and sizes and all(isinstance(s, int) and s > 0 for s in sizes):
        return max(sizes)
    return None
