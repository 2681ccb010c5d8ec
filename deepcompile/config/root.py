"""The whole configuration: the top-level keys and the sections, and the entry points
(``Config.from_any``, ``resolve``, ``runtime_config``)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from deepcompile.config import auto, rules, runtime_settings
from deepcompile.config.batch import complete_batch_sizes
from deepcompile.config.compile_section import CompileConfig
from deepcompile.config.deepspeed_sections import (ActivationCheckpointingConfig, AioConfig, CsvMonitorConfig,
                                                   HybridEngineConfig, TensorboardConfig, WandbConfig)
from deepcompile.config.faults import FaultToleranceConfig
from deepcompile.config.optim import OPTIMIZER_TYPES, SCHEDULER_TYPES, OptimizerConfig, SchedulerConfig, HF_FILLS
from deepcompile.config.precision import Bf16Config, Fp16Config, communication_data_type
from deepcompile.config.schema import Section, fixed_key, key, no_effect_key, section
from deepcompile.config.validators import any_object, boolean, integer, integer_or_never, number, optional
from deepcompile.config.zero import OFFLOAD_KEYS, ZeroConfig

_UNTESTED = "torch.optim.Adam, AdamW and SGD"


def load_json_object(path_like: Any) -> Dict[str, Any]:
    """The JSON object in a config file; a ValueError naming the file otherwise."""
    path = os.fspath(path_like)
    with open(path, encoding="utf-8") as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {path}: invalid JSON: {e}") from e
    if not isinstance(d, dict):
        raise ValueError(f"config file {path} must hold a JSON object, got {type(d).__name__}")
    return d


@dataclasses.dataclass(frozen=True)
class Config(Section):
    """The whole configuration. Build it with :meth:`from_any` / :meth:`from_dict`."""

    _aliases = {"bfloat16": "bf16"}
    # DeepSpeed reads "bfloat16" (its old name) only when "bf16" is absent or null.
    _key_wins = frozenset({"bf16"})

    zero_optimization: ZeroConfig = key(section(ZeroConfig), factory=ZeroConfig,
                                        doc="ZeRO settings; 'stage' is required.")
    compile: CompileConfig = key(section(CompileConfig), factory=CompileConfig, doc="DeepCompile settings.")
    bf16: Bf16Config = key(section(Bf16Config), factory=Bf16Config, doc="bfloat16 training (alias: bfloat16).")
    fp16: Fp16Config = key(section(Fp16Config), factory=Fp16Config, doc="fp16 training with loss scaling.")
    optimizer: Optional[OptimizerConfig] = key(
        optional(section(OptimizerConfig)), None,
        "The optimizer deepcompile builds when initialize gets none (an optimizer object and this section together "
        "are an error).")
    scheduler: Optional[SchedulerConfig] = key(
        optional(section(SchedulerConfig)), None,
        "The learning-rate schedule, stepped once per optimizer step (a lr_scheduler passed to initialize and this "
        "section together are an error).")
    train_micro_batch_size_per_gpu: Optional[int] = key(
        optional(integer(1)), None, "Micro-batch size per rank: checked against the other batch keys (the engine "
        "does not load data).", auto="train_batch_size / (gradient_accumulation_steps * world_size)")
    train_batch_size: Optional[int] = key(optional(integer(1)), None,
                                          "Global batch size; see check_batch_size().",
                                          auto="train_micro_batch_size_per_gpu * gradient_accumulation_steps * "
                                               "world_size")
    gradient_accumulation_steps: Optional[int] = key(
        optional(integer(1)), None, "Micro-batches per optimizer step. Unset: train_batch_size / (micro * world) "
        "when both are given, else 1 (as DeepSpeed).",
        auto="train_batch_size / (train_micro_batch_size_per_gpu * world_size)")
    gradient_clipping: float = key(number(0.0), 0.0, "Max global gradient norm; 0 disables clipping.",
                                   no_auto=HF_FILLS.format("max_grad_norm"))
    steps_per_print: Union[int, float] = key(
        integer_or_never(1), 10, "Every this many optimizer steps rank 0 logs the step and learning rates (and, with "
        "wall_clock_breakdown, the times) to the 'deepcompile' logger at INFO level. Infinity (float('inf'), as "
        "accelerate writes): never.")
    wall_clock_breakdown: bool = key(boolean, False, "Time forward, backward and the optimizer step (synchronizing "
                                     "the device around each) and log the mean per step every steps_per_print "
                                     "steps.")
    communication_data_type: Optional[str] = key(
        communication_data_type, None,
        "dtype of gradient reductions: \"fp32\" or \"bf16\" (\"fp16\" is refused). Unset: ZeRO-3 reduces in fp32, "
        "ZeRO-1/2 in the parameters' dtype. ZeRO-3 honours both (\"bf16\" with gradient_accumulation_steps 1 "
        "only); ZeRO-1/2 only the parameters' dtype (docs/config.md says why).")
    prescale_gradients: bool = fixed_key("prescale_gradients")
    gradient_predivide_factor: float = fixed_key("gradient_predivide_factor")
    sequence_parallel_size: int = key(
        integer(1), 1, "Ulysses sequence parallelism: this many consecutive ranks share each sequence, each holding "
        "a contiguous slice of it; attention runs over the whole sequence through all-to-alls the compiler inserts "
        "(docs/design/sequence-parallel.md). Must divide the world size; batch sizes count world_size / this many "
        "replicas. Needs a compiled engine.")
    zero_allow_untested_optimizer: bool = key(
        boolean, False, f"false: an optimizer object other than {_UNTESTED} (the ones deepcompile's tests cover) is "
        "refused; true: any torch.optim.Optimizer is accepted.")
    zero_force_ds_cpu_optimizer: bool = no_effect_key("zero_force_ds_cpu_optimizer", boolean, True)
    activation_checkpointing: ActivationCheckpointingConfig = key(
        section(ActivationCheckpointingConfig), factory=ActivationCheckpointingConfig,
        doc="DeepSpeed's activation-checkpointing API: only its off settings.")
    tensorboard: TensorboardConfig = key(section(TensorboardConfig), factory=TensorboardConfig, doc="Only disabled.")
    csv_monitor: CsvMonitorConfig = key(section(CsvMonitorConfig), factory=CsvMonitorConfig, doc="Only disabled.")
    wandb: WandbConfig = key(section(WandbConfig), factory=WandbConfig, doc="Only disabled.")
    hybrid_engine: HybridEngineConfig = key(section(HybridEngineConfig), factory=HybridEngineConfig,
                                            doc="Only disabled.")
    aio: AioConfig = key(section(AioConfig), factory=AioConfig,
                         doc="DeepSpeed's NVMe I/O settings: any valid values, no effect (no NVMe offload).")
    fault_tolerance: FaultToleranceConfig = key(
        section(FaultToleranceConfig), factory=FaultToleranceConfig,
        doc="What every rank does when another fails (deepcompile's section, not DeepSpeed's; docs/faults.md).")
    monitor_config: Optional[dict] = no_effect_key("monitor_config", optional(any_object), None)
    comms_config: Optional[dict] = no_effect_key("comms_config", optional(any_object), None)

    def _check_together(self, valid: Callable[[str], bool]) -> List[Tuple[str, str]]:
        # A section that failed its own checks is left as given (not a section object): skip.
        sections = ((self.compile, CompileConfig), (self.zero_optimization, ZeroConfig), (self.bf16, Bf16Config),
                    (self.fp16, Fp16Config))
        if not all(isinstance(value, cls) for value, cls in sections):
            return []
        return rules.refusals(self, "parse", valid=valid)

    def to_dict(self) -> Dict[str, Any]:
        out = super().to_dict()
        for name in ("optimizer", "scheduler", "monitor_config", "comms_config"):
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
            return cls.from_dict(load_json_object(obj))
        raise TypeError(
            f"config must be a dict, a path to a JSON file or a deepcompile.Config, got {type(obj).__name__}"
        )

    def check_batch_size(self, world_size: int) -> None:
        """Raise ValueError unless the batch sizes agree for ``world_size`` ranks.

        Any two of train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps
        determine the third (``train_batch_size = micro * gas * world``); all three must agree, and
        a derived one must come out whole. Nothing to check when none is given.
        """
        complete_batch_sizes(self, world_size)

    def resolve(self, world_size: int, model: Any = None) -> "Config":
        """This config with every ``"auto"`` it can derive filled in, checked against the model
        (``auto.py``). Raises :class:`ConfigError` naming every key that cannot be honoured."""
        return auto.resolve(self, world_size, model)

    def notices(self) -> List[str]:
        """Warnings for accepted settings that have no effect in this combination (rules.NOTICES)."""
        return rules.notices(self)

    def runtime_config(self) -> Dict[str, Any]:
        """Keyword arguments for :class:`deepcompile.runtime.RuntimeConfig`."""
        return runtime_settings.runtime_config(self)


_SECTIONS = {"zero_optimization": ZeroConfig, "compile": CompileConfig, "bf16": Bf16Config, "fp16": Fp16Config,
             "activation_checkpointing": ActivationCheckpointingConfig, "tensorboard": TensorboardConfig,
             "csv_monitor": CsvMonitorConfig, "wandb": WandbConfig, "hybrid_engine": HybridEngineConfig,
             "aio": AioConfig, "optimizer": OptimizerConfig, "scheduler": SchedulerConfig, "fault_tolerance": FaultToleranceConfig}


def accepted_keys() -> List[str]:
    """Every dotted key a config may hold (aliases aside): the sections' fields, the keys of the
    two offload objects and the ``params`` keys of every optimizer and scheduler type. The
    ``optimizer`` and ``scheduler`` sections are keys of their own; their ``params`` object is not."""
    keys = {"optimizer", "scheduler"}
    for f in dataclasses.fields(Config):
        cls = _SECTIONS.get(f.name)
        if cls is None:
            keys.add(f.name)
            continue
        keys.update(f"{f.name}.{g.name}" for g in dataclasses.fields(cls) if g.name != "params")
    for name, sub_keys in OFFLOAD_KEYS.items():
        keys.update(f"zero_optimization.{name}.{k}" for k in sub_keys)
    for section, types in (("optimizer", OPTIMIZER_TYPES), ("scheduler", SCHEDULER_TYPES)):
        for spec in types.values():
            keys.update(f"{section}.params.{name}" for name in spec)
    return sorted(keys)
