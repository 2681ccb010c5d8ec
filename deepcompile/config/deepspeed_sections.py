"""DeepSpeed sections for features deepcompile does not have: accepted only switched off, their
other keys validated and inert (``inert.py`` holds every reason)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from deepcompile.config.schema import Section, fixed_key, inert_key, no_effect_key
from deepcompile.config.validators import boolean, integer, optional, string


@dataclasses.dataclass(frozen=True)
class ActivationCheckpointingConfig(Section):
    _path = "activation_checkpointing"
    partition_activations: bool = fixed_key("activation_checkpointing.partition_activations")
    cpu_checkpointing: bool = fixed_key("activation_checkpointing.cpu_checkpointing")
    contiguous_memory_optimization: bool = fixed_key("activation_checkpointing.contiguous_memory_optimization")
    number_checkpoints: Optional[int] = inert_key("activation_checkpointing.number_checkpoints",
                                                  optional(integer(1)), None)
    synchronize_checkpoint_boundary: bool = fixed_key("activation_checkpointing.synchronize_checkpoint_boundary")
    profile: bool = fixed_key("activation_checkpointing.profile")


@dataclasses.dataclass(frozen=True)
class TensorboardConfig(Section):
    _path = "tensorboard"
    enabled: bool = fixed_key("tensorboard.enabled")
    output_path: str = inert_key("tensorboard.output_path", string, "")
    job_name: str = inert_key("tensorboard.job_name", string, "DeepSpeedJobName")


@dataclasses.dataclass(frozen=True)
class CsvMonitorConfig(Section):
    _path = "csv_monitor"
    enabled: bool = fixed_key("csv_monitor.enabled")
    output_path: str = inert_key("csv_monitor.output_path", string, "")
    job_name: str = inert_key("csv_monitor.job_name", string, "DeepSpeedJobName")


@dataclasses.dataclass(frozen=True)
class WandbConfig(Section):
    _path = "wandb"
    enabled: bool = fixed_key("wandb.enabled")
    group: Optional[str] = inert_key("wandb.group", optional(string), None)
    team: Optional[str] = inert_key("wandb.team", optional(string), None)
    project: str = inert_key("wandb.project", string, "deepspeed")


@dataclasses.dataclass(frozen=True)
class HybridEngineConfig(Section):
    _path = "hybrid_engine"
    enabled: bool = fixed_key("hybrid_engine.enabled")
    max_out_tokens: int = inert_key("hybrid_engine.max_out_tokens", integer(1), 512)
    inference_tp_size: int = inert_key("hybrid_engine.inference_tp_size", integer(1), 1)
    release_inference_cache: bool = inert_key("hybrid_engine.release_inference_cache", boolean, False)
    pin_parameters: bool = inert_key("hybrid_engine.pin_parameters", boolean, True)
    tp_gather_partition_size: int = inert_key("hybrid_engine.tp_gather_partition_size", integer(1), 8)


@dataclasses.dataclass(frozen=True)
class AioConfig(Section):
    """DeepSpeed's NVMe I/O settings: no NVMe offload here, so no value changes anything."""

    _path = "aio"
    block_size: int = no_effect_key("aio.block_size", integer(1), 1048576)
    queue_depth: int = no_effect_key("aio.queue_depth", integer(1), 8)
    single_submit: bool = no_effect_key("aio.single_submit", boolean, False)
    overlap_events: bool = no_effect_key("aio.overlap_events", boolean, True)
    thread_count: int = no_effect_key("aio.thread_count", integer(1), 1)
    use_gds: bool = no_effect_key("aio.use_gds", boolean, False)
