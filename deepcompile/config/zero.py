"""The ``zero_optimization`` section, with its two offload objects."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from deepcompile.config.errors import ConfigError, show
from deepcompile.config.schema import Section, fixed_key, key, off_only_key
from deepcompile.config.validators import boolean, check_keys, integer, number, optional, string


def _stage(value: Any, dotted: str) -> int:
    if value is None:
        raise ValueError(f"{dotted} is required (1, 2 or 3)")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{dotted} must be 1, 2 or 3, got {show(value)}")
    if value == 0:
        raise ValueError(f"{dotted}: stage 0 is not supported; deepcompile needs ZeRO stage 1, 2 or 3")
    if value not in (1, 2, 3):
        raise ValueError(f"{dotted} must be 1, 2 or 3, got {value!r}")
    return value


def _shard_size(value: Any, dotted: str) -> int:
    """-1 (DeepSpeed's default): no hybrid sharding; otherwise a positive number of ranks (that it
    divides the world size is checked when the world is known, config/rules.py)."""
    if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or value >= 1):
        raise ValueError(f"{dotted} must be -1 (shard over the whole world) or a positive number of ranks, "
                         f"got {show(value)}")
    return value


def _hpz_size(value: Any, dotted: str) -> int:
    """1 (DeepSpeed's default): no secondary partition; otherwise a positive number of consecutive
    ranks (that it divides the world size is checked when the world is known, config/rules.py)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{dotted} must be a positive number of ranks (1: off), got {show(value)}")
    return value


def _sub_group_size(value: Any, dotted: str) -> Optional[int]:
    """DeepSpeed accepts 0, which closes a sub-group after every parameter: 1 does the same here."""
    if value is None:
        return None
    return max(1, integer(0)(value, dotted))


# ---- offload_param / offload_optimizer

@dataclasses.dataclass(frozen=True)
class OffloadParam:
    """``zero_optimization.offload_param`` with ``device: "cpu"``: ZeRO-3 parameter offload."""

    device: str = "cpu"
    pin_memory: bool = False  # DeepSpeed's default


@dataclasses.dataclass(frozen=True)
class OffloadOptimizer:
    """``zero_optimization.offload_optimizer`` with ``device: "cpu"`` (deepcompile/offload/)."""

    device: str = "cpu"
    pin_memory: bool = False  # DeepSpeed's default
    # The least fraction of the offloadable optimizer-state bytes kept on the host (DeepSpeed's
    # "ratio", default 1.0: all of it); the memory budget may require more.
    ratio: float = 1.0


# The keys only NVMe offload reads: validated, no effect with device "cpu" (rows of inert.INERT).
_PARAM_NVME_ONLY = {"nvme_path": optional(string), "buffer_count": integer(1), "buffer_size": integer(1),
                    "max_in_cpu": integer(0)}
_OPTIMIZER_NVME_ONLY = {"nvme_path": optional(string), "buffer_count": integer(1), "pipeline_read": boolean,
                        "pipeline_write": boolean, "fast_init": boolean}
_PARAM_KEYS = ("device", *_PARAM_NVME_ONLY, "pin_memory")
_OPTIMIZER_KEYS = ("device", *_OPTIMIZER_NVME_ONLY, "pin_memory", "ratio")
OFFLOAD_KEYS = {"offload_param": _PARAM_KEYS, "offload_optimizer": _OPTIMIZER_KEYS}


def _offload_device(value: Any, dotted: str, keys, what: str) -> Optional[str]:
    """The checked device of an offload object; None when it is off (absent, null, "none")."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{dotted} must be an object or null, got {show(value)}")
    check_keys(value, keys, dotted)
    device = value.get("device", "none")
    if device is None or device == "none":
        return None
    if device == "nvme":
        raise ConfigError([(f"{dotted}.device", f"{dotted}.device is 'nvme': {what} is not implemented; use "
                                                 "\"cpu\" (host memory) or \"none\"")])
    if device != "cpu":
        raise ConfigError([(f"{dotted}.device", f"{dotted}.device must be \"none\", \"cpu\" or \"nvme\", got "
                                                 f"{show(device)}")])
    return device


def _offload_param(value: Any, dotted: str) -> Optional[OffloadParam]:
    """``device: "cpu"``: the ZeRO-3 parameter shards live in host memory (deepcompile/offload/)."""
    if value is None or isinstance(value, OffloadParam):  # already checked (dataclasses.replace re-checks)
        return value
    if _offload_device(value, dotted, _PARAM_KEYS, "NVMe parameter offload") is None:
        return None
    for name, check in _PARAM_NVME_ONLY.items():
        if name in value:
            check(value[name], f"{dotted}.{name}")
    return OffloadParam(device="cpu", pin_memory=boolean(value.get("pin_memory", False), f"{dotted}.pin_memory"))


def _offload_optimizer(value: Any, dotted: str) -> Optional[OffloadOptimizer]:
    """``device: "cpu"``: optimizer-state offload to host memory."""
    if value is None or isinstance(value, OffloadOptimizer):
        return value
    if _offload_device(value, dotted, _OPTIMIZER_KEYS, "NVMe offload") is None:
        return None
    for name, check in _OPTIMIZER_NVME_ONLY.items():
        if name in value:
            check(value[name], f"{dotted}.{name}")
    return OffloadOptimizer(device="cpu", pin_memory=boolean(value.get("pin_memory", False), f"{dotted}.pin_memory"),
                            ratio=number(0.0, 1.0, low_open=True)(value.get("ratio", 1.0), f"{dotted}.ratio"))


# ---- the section

_LIMIT = ("{what}, in parameter elements, as DeepSpeed counts them; the schedule planner keeps to it alongside "
          "the memory budget (scheduling/planner.py). 0 {zero}; null: no limit")
_HIDDEN = " \"auto\": {}, where hidden_size is model.config.hidden_size (else this key's default)."
_ONE_BLOCK = (" \"auto\": the elements of the model's largest block named in _no_split_modules (a decoder layer), at "
              "least {} and at most {} (docs/config.md), where hidden_size is model.config.hidden_size (else this "
              "key's default).")
# DeepSpeed's names: its fields are the unprefixed ones, the stage3_ names their aliases (and
# stage3_gather_fp16_weights_on_model_save a deprecated spelling). The fields here keep the
# stage3_ names; both spellings are read.
_ZERO_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}


@dataclasses.dataclass(frozen=True)
class ZeroConfig(Section):
    """``zero_optimization``. The keys of one ZeRO stage are inert under the others (validated
    only), so that one config serves every stage by changing ``stage`` alone, as in DeepSpeed."""

    _path = "zero_optimization"
    _aliases = _ZERO_ALIASES

    stage: int = key(_stage, None, "ZeRO stage: 1, 2 or 3. Required (DeepSpeed's default 0 is unsupported).")
    reduce_bucket_size: int = key(integer(1), 500_000_000, "Elements per gradient reduce bucket."
                                  + _ONE_BLOCK.format("hidden_size ** 2", "5e8"),
                                  auto="one decoder layer's elements (at least hidden_size ** 2)")
    allgather_bucket_size: int = key(
        integer(1), 500_000_000,
        "ZeRO-1/2: elements all-gathered per collective when the updated partitions are gathered after the "
        "optimizer step. Inert under ZeRO-3, which gathers by stage3_prefetch_bucket_size (as DeepSpeed).")
    allgather_partitions: bool = fixed_key("zero_optimization.allgather_partitions")
    reduce_scatter: bool = fixed_key("zero_optimization.reduce_scatter")
    overlap_comm: bool = key(
        boolean, True, "true: gradient reductions run on a dedicated stream, overlapping the backward, with two "
        "reduce buckets (compile.double_buffer). false (DeepSpeed's default under ZeRO-1/2): the backward waits for "
        "each reduction (a device sync after each reduce_grad) and one bucket is used, as DeepSpeed reduces on the "
        "compute stream.")
    contiguous_gradients: bool = fixed_key("zero_optimization.contiguous_gradients")
    round_robin_gradients: bool = fixed_key("zero_optimization.round_robin_gradients")
    stage3_param_persistence_threshold: int = key(
        integer(0), 100_000, "ZeRO-3 (inert under ZeRO-1/2): parameters with at most this many elements stay "
        "gathered. Alias param_persistence_threshold." + _HIDDEN.format("10 * hidden_size"),
        auto="10 * hidden_size")
    stage3_prefetch_bucket_size: int = key(
        integer(0), 50_000_000, "ZeRO-3 (inert under ZeRO-1/2): elements per fused prefetch group (0: one "
        "parameter per group). Alias prefetch_bucket_size." + _ONE_BLOCK.format("int(0.9 * hidden_size ** 2)", "5e7"),
        auto="one decoder layer's elements (at least int(0.9 * hidden_size ** 2))")
    stage3_max_live_parameters: Optional[int] = key(
        optional(integer(0)), None, "ZeRO-3 (inert under ZeRO-1/2), alias max_live_parameters: "
        + _LIMIT.format(what="the most elements held gathered beyond what the op in flight needs (prefetched ahead plus "
                       "kept gathered)", zero="turns prefetching off (DeepSpeed prefetches nothing then)") + ".")
    stage3_max_reuse_distance: Optional[int] = key(
        optional(integer(0)), None, "ZeRO-3 (inert under ZeRO-1/2), alias max_reuse_distance: "
        + _LIMIT.format(what="a parameter is kept gathered only if the other gathers bring in at most this many "
                       "elements between two of its uses",
                       zero="turns selective gathering off (DeepSpeed keeps no released parameter then)") + ".")
    stage3_gather_16bit_weights_on_model_save: Any = key(
        boolean, False, "ZeRO-3: the served DeepSpeedEngine.save_16bit_model (Trainer's save_model) gathers and "
        "writes the full 16-bit weights only when true, as DeepSpeed does (false: it warns and returns False). "
        "engine.save_hf() and engine.full_state_dict() gather whenever they are called.",
        auto="kept, and read as true")
    sub_group_size: Optional[int] = key(
        _sub_group_size, None,
        "ZeRO-3 (inert under ZeRO-1/2, as in DeepSpeed, whose ZeRO-1/2 step their flat partitions whole): the "
        "optimizer step updates at most this many master elements at a time, dropping each sub-group's gradients "
        "after it (lower step peak), and optimizer-state offload streams the step per sub-group. 0 (as DeepSpeed): "
        "one parameter per sub-group, read as 1. Null: DeepSpeed's default, 1e9 elements.")
    offload_param: Optional[OffloadParam] = key(
        _offload_param, None, "ZeRO-3 parameter offload: {\"device\": \"cpu\", \"pin_memory\": bool (default false)} "
        "keeps every rank's parameter shards (the fp32 masters) in host memory between steps; gathers read them from "
        "there. \"none\"/null: off; \"nvme\": refused; stages 1 and 2: refused.")
    offload_optimizer: Optional[OffloadOptimizer] = key(
        _offload_optimizer, None, "Optimizer-state offload to host memory: {\"device\": \"cpu\", \"pin_memory\": "
        "bool, \"ratio\": least fraction offloaded (default 1.0)}; \"none\"/null: off; \"nvme\": refused. All stages.")
    cpu_offload: bool = off_only_key("zero_optimization.cpu_offload")
    memory_efficient_linear: bool = fixed_key("zero_optimization.memory_efficient_linear")
    zero_quantized_weights: bool = fixed_key("zero_optimization.zero_quantized_weights")
    zero_quantized_nontrainable_weights: bool = fixed_key("zero_optimization.zero_quantized_nontrainable_weights")
    zero_quantized_gradients: bool = fixed_key("zero_optimization.zero_quantized_gradients")
    zero_hpz_partition_size: int = key(
        _hpz_size, 1,
        "ZeRO++ hpZ: besides the primary shards over the whole world, every ZeRO-3 parameter that is not persistent "
        "keeps a secondary copy in its gather dtype sharded over groups of this many consecutive ranks (a node); "
        "the first gather after each optimizer step reads the primary shards over the world and leaves the "
        "secondary copy behind, every later gather until the next step (the backward's, further micro-steps') reads "
        "it within the group (docs/design/hpz.md). Must divide the world size; 1 (default): off. ZeRO-3 only, "
        "not together with hybrid sharding (mics_shard_size).")
    mics_shard_size: int = key(
        _shard_size, -1,
        "Hybrid sharding (DeepSpeed's MiCS, FSDP's HSDP): parameters, gradients and optimizer state are "
        "partitioned over shard groups of this many consecutive ranks and replicated across the groups; gathers and "
        "reduce-scatters stay inside a shard group, and each reduced gradient partition is then all-reduced across "
        "the replicas (docs/design/hybrid_sharding.md). Must divide the world size. -1 (default) or the world size: "
        "plain ZeRO over the whole world. All stages; initialize(shard_group_size=) sets the same.")
    mics_hierarchical_params_gather: bool = off_only_key("zero_optimization.mics_hierarchical_params_gather")
