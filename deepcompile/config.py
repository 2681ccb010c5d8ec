"""User configuration: the part of DeepSpeed's JSON config that deepcompile understands.

``deepcompile.initialize(model, optimizer, config)`` takes ``config`` as a dict, a path to a JSON
file or a :class:`Config`; :meth:`Config.from_any` turns each into a validated, immutable
:class:`Config`.

Compatibility policy
--------------------
* Key names, nesting and units are DeepSpeed's (``zero_optimization.reduce_bucket_size`` in
  elements, ``compile.free_activation_threshold`` in bytes, ...), so the relevant part of an
  existing DeepSpeed config can be reused as is.
* Only keys that apply to deepcompile are accepted. Any other key is an error, never silently
  ignored: the ``ValueError`` names the full dotted key (``zero_optimization.stgae``) and lists the
  keys supported in that section.
* Some DeepSpeed keys are *informational*: accepted, validated and kept (so configs stay portable),
  but they change nothing here. Their documentation says so.
* Features DeepSpeed has and deepcompile does not (fp16, ZeRO offload, activation / optimizer-state /
  parameter offload, symmetric memory) are accepted only in their "off" setting; turning one on is
  an error that says it is not supported.
* Types are strict: booleans must be ``true``/``false`` (not 0/1 or strings); integers reject
  booleans and non-integral floats, but integral floats such as ``5e8`` are accepted as ints.
* Two defaults differ from DeepSpeed's: ``compile.deepcompile`` is true (this package always
  compiles through its own passes) and ``zero_optimization.stage`` has no default (it is required:
  1, 2 or 3).
* ``compile`` also holds deepcompile's own scheduling keys (``warmup_steps``, ``prefetch``,
  ``selective_gather``, ``memory_budget_fraction``), which replace DeepSpeed's hard-coded schedule
  (design doc, compiler-passes.md §2.2).

Every section is a frozen dataclass whose fields carry their validator and documentation
(``field.metadata["check"]``, ``field.metadata["doc"]``): the dataclass *is* the table of
supported keys. Validation runs in ``__post_init__``, so direct construction and
``dataclasses.replace`` are validated too.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from typing import Any, Callable, Dict, Mapping, Optional

from deepcompile.scheduling.schedule import PASS_NAMES

__all__ = ["Config", "ZeroConfig", "CompileConfig", "Bf16Config", "Fp16Config"]

# A validator takes the value and its full dotted key, returns the normalized value, and raises
# ValueError naming the key when the value is invalid.
Check = Callable[[Any, str], Any]

INFO = "Informational: accepted for DeepSpeed compatibility, no effect."


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


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


def _off_only(feature: str) -> Check:
    """A DeepSpeed switch for a feature deepcompile lacks: only ``false`` is accepted."""

    def check(value: Any, key: str) -> bool:
        if _bool(value, key):
            raise ValueError(f"{key}: {feature} is not supported yet; set it to false or remove it")
        return False

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


# DeepSpeed's keys of offload_param / offload_optimizer. With device "none" the others are inert.
_OFFLOAD_KEYS = {
    "offload_param": ("device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"),
    "offload_optimizer": ("device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read",
                          "pipeline_write", "fast_init", "ratio"),
}


def _no_offload(value: Any, key: str) -> None:
    """ZeRO offload: accepted only when absent/null or with ``device: "none"``; normalized to None."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} must be an object or null, got {_show(value)}")
    _check_keys(value, _OFFLOAD_KEYS[key.rsplit(".", 1)[-1]], key)
    device = value.get("device", "none")
    if device is not None and device != "none":
        raise ValueError(
            f"{key}.device is {device!r}: offload is not supported yet; only \"none\" is accepted"
        )
    return None


def _section(cls: type) -> Check:
    def check(value: Any, key: str):
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"{key} must be an object, got {_show(value)}")
        return cls.from_dict(value)

    return check


def _key(check: Check, default: Any = dataclasses.MISSING, doc: str = "", factory: Any = dataclasses.MISSING):
    return dataclasses.field(default=default, default_factory=factory, metadata={"check": check, "doc": doc})


def _check_keys(d: Mapping, supported, path: str) -> None:
    for k in d:
        if k not in supported:
            name = f"{path}.{k}" if path else str(k)
            where = f"{path}" if path else "the top level"
            hint = difflib.get_close_matches(str(k), list(supported), n=1)
            hint = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ValueError(
                f"unknown config key {name!r}{hint}; supported keys of {where}: {', '.join(supported)}"
            )


# ----------------------------------------------------------------------------------- sections


class _Section:
    _path = ""  # dotted path of the section in the JSON config; "" for the top level

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            key = f"{self._path}.{f.name}" if self._path else f.name
            object.__setattr__(self, f.name, f.metadata["check"](getattr(self, f.name), key))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        if not isinstance(d, Mapping):
            raise TypeError(f"{cls.__name__}.from_dict expects a mapping, got {type(d).__name__}")
        _check_keys(d, [f.name for f in dataclasses.fields(cls)], cls._path)
        return cls(**d)

    def to_dict(self) -> Dict[str, Any]:
        return {
            f.name: v.to_dict() if isinstance(v, _Section) else v
            for f in dataclasses.fields(self)
            for v in (getattr(self, f.name),)
        }


@dataclasses.dataclass(frozen=True)
class Bf16Config(_Section):
    _path = "bf16"
    enabled: bool = _key(_bool, False, "Train in bfloat16 (parameters and gradients); fp32 master weights.")


@dataclasses.dataclass(frozen=True)
class Fp16Config(_Section):
    _path = "fp16"
    enabled: bool = _key(_fp16_enabled, False, "Only false is accepted: fp16 is not supported; use bf16.")


@dataclasses.dataclass(frozen=True)
class ZeroConfig(_Section):
    _path = "zero_optimization"
    stage: int = _key(_stage, None, "ZeRO stage: 1, 2 or 3. Required (DeepSpeed's default 0 is unsupported).")
    reduce_bucket_size: int = _key(_integer(1), 500_000_000, "Elements per gradient reduce bucket.")
    stage3_param_persistence_threshold: int = _key(
        _integer(0), 100_000, "ZeRO-3: parameters with at most this many elements stay gathered.")
    contiguous_gradients: bool = _key(_bool, True, INFO)
    overlap_comm: bool = _key(_bool, True, INFO + " Communication always overlaps compute.")
    allgather_bucket_size: int = _key(_integer(1), 500_000_000, INFO)
    stage3_prefetch_bucket_size: int = _key(_integer(0), 50_000_000,
                                           "ZeRO-3: elements per fused prefetch group (0: one parameter per group).")
    stage3_max_live_parameters: int = _key(_integer(0), 1_000_000_000, INFO)
    stage3_max_reuse_distance: int = _key(_integer(0), 1_000_000_000, INFO)
    offload_param: None = _key(_no_offload, None, "Only absent, null or {\"device\": \"none\"}.")
    offload_optimizer: None = _key(_no_offload, None, "Only absent, null or {\"device\": \"none\"}.")


@dataclasses.dataclass(frozen=True)
class CompileConfig(_Section):
    _path = "compile"
    deepcompile: bool = _key(_bool, True, "Compile through deepcompile's passes when engine.compile() is "
                             "called (DeepSpeed's default is false; here it is true).")
    free_activation: bool = _key(_bool, False, "Free backward inputs eagerly after their last use.")
    free_activation_threshold: int = _key(_integer(0), 10 * 1024 * 1024,
                                          "Bytes; tensors at least this large are freed by free_activation.")
    offload_activation: bool = _key(_off_only("activation offload"), False, "Only false is accepted.")
    offload_activation_pin_memory: bool = _key(_bool, True, INFO + " (Belongs to offload_activation.)")
    offload_opt_states: bool = _key(_off_only("optimizer-state offload"), False, "Only false is accepted.")
    offload_parameters: bool = _key(_off_only("parameter offload"), False, "Only false is accepted.")
    symmetric_memory: bool = _key(_off_only("symmetric memory"), False, "Only false is accepted.")
    double_buffer: bool = _key(_bool, True, "Double-buffered gradient reduce buckets.")
    debug_log: bool = _key(_bool, False, "Rank-0 graph and timing logs.")
    debug_checks: bool = _key(_bool, False, "Verify while training that no parameter placeholder reaches a "
                              "computation and that every gradient is reduced exactly as often as it is "
                              "produced (deepcompile/debug_checks.py); raises DebugCheckError otherwise.")
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
    memory_budget_fraction: float = _key(_number(0.0, 1.0, low_open=True), 0.9,
                                         "Fraction of device memory the profile-guided passes may plan for.")
    memory_budget_bytes: Optional[int] = _key(_optional(_integer(1)), None,
                                              "Bytes the profile-guided passes may plan for; overrides "
                                              "memory_budget_fraction when set.")


@dataclasses.dataclass(frozen=True)
class Config(_Section):
    """The whole configuration. Build it with :meth:`from_any` / :meth:`from_dict`."""

    zero_optimization: ZeroConfig = _key(_section(ZeroConfig), factory=ZeroConfig,
                                         doc="ZeRO settings; 'stage' is required.")
    compile: CompileConfig = _key(_section(CompileConfig), factory=CompileConfig, doc="DeepCompile settings.")
    bf16: Bf16Config = _key(_section(Bf16Config), factory=Bf16Config, doc="bfloat16 training.")
    fp16: Fp16Config = _key(_section(Fp16Config), factory=Fp16Config, doc="Only disabled fp16 is accepted.")
    train_micro_batch_size_per_gpu: Optional[int] = _key(_optional(_integer(1)), None,
                                                         "Micro-batch size per rank (informational).")
    train_batch_size: Optional[int] = _key(_optional(_integer(1)), None,
                                           "Global batch size; see check_batch_size().")
    gradient_accumulation_steps: int = _key(_integer(1), 1, "Micro-batches per optimizer step.")
    gradient_clipping: float = _key(_number(0.0), 0.0, "Max global gradient norm; 0 disables clipping.")
    steps_per_print: int = _key(_integer(1), 10, "Log every this many optimizer steps.")
    wall_clock_breakdown: bool = _key(_bool, False, INFO)

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

    def check_batch_size(self, world_size: int) -> None:
        """Raise ValueError unless the batch sizes agree for ``world_size`` ranks.

        With ``train_micro_batch_size_per_gpu`` given, ``train_batch_size`` must equal
        micro * gradient_accumulation_steps * world_size; without it, it must be divisible by
        gradient_accumulation_steps * world_size. Nothing to check when train_batch_size is unset.
        """
        world = _integer(1)(world_size, "world_size")
        tbs, micro = self.train_batch_size, self.train_micro_batch_size_per_gpu
        gas = self.gradient_accumulation_steps
        if tbs is None:
            return
        if micro is not None and tbs != micro * gas * world:
            raise ValueError(
                f"train_batch_size ({tbs}) must equal train_micro_batch_size_per_gpu ({micro}) * "
                f"gradient_accumulation_steps ({gas}) * world size ({world}) = {micro * gas * world}"
            )
        if micro is None and tbs % (gas * world):
            raise ValueError(
                f"train_batch_size ({tbs}) must be divisible by gradient_accumulation_steps ({gas}) * "
                f"world size ({world}) = {gas * world}"
            )

    def runtime_config(self) -> Dict[str, Any]:
        """Keyword arguments for :class:`deepcompile.runtime.RuntimeConfig`.

        The keys are checked against RuntimeConfig's fields so the two cannot drift apart.
        """
        from deepcompile.runtime import RuntimeConfig  # imports the C++ extension

        c = self.compile
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
