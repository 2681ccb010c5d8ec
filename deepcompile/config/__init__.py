"""User configuration: DeepSpeed's JSON config, as people write it, mapped onto deepcompile.

``deepcompile.initialize(model, optimizer, config)`` takes ``config`` as a dict, a path to a JSON
file or a :class:`Config`; :meth:`Config.from_any` turns each into a validated, immutable
:class:`Config`, and the engine then fills its ``"auto"`` values (:meth:`Config.resolve`).
``docs/config.md`` has the table of every key and how it is handled.

Compatibility policy
--------------------
* Key names, nesting and units are DeepSpeed's (``zero_optimization.reduce_bucket_size`` in
  elements, ``compile.free_activation_threshold`` in bytes, ...), and so are its alternative
  spellings (``max_live_parameters`` for ``stage3_max_live_parameters``, ``bfloat16`` for
  ``bf16``, ...), so the configs Hugging Face, accelerate and the fine-tuning projects ship are
  read as they are. Two spellings of one key with different values are an error.
* Nothing is accepted and then ignored. Every key is either read by the code, or refused with an
  error that says why, or listed with its reason in ``inert.py`` (accepted only with the value that
  describes the runtime, only switched off, inert because its feature is off, or without effect
  for any value). Unknown keys are errors naming the dotted key and listing the keys of that
  section.
* All problems of a config are reported at once: :class:`ConfigError` (a ``ValueError``) carries
  every ``(dotted key, message)`` pair.
* ``zero_optimization.stage`` has no default (it is required: 1, 2 or 3).

The package is data: importing it loads neither torch nor the C++ extension.

Modules: ``errors`` / ``validators`` / ``schema`` (the machinery), one module per area
(``zero``, ``compile_section``, ``precision``, ``optim``, ``deepspeed_sections``, ``faults``, ``root``),
``inert`` (the keys without effect, with their reasons), ``rules`` (every rule across features),
``batch`` and ``auto`` (``"auto"`` resolution: the only part that looks at the model),
``runtime_settings`` (what the C++ runtime takes).
"""

from deepcompile.config.compile_section import PASS_NAMES, CompileConfig
from deepcompile.config.deepspeed_sections import (ActivationCheckpointingConfig, CsvMonitorConfig, HybridEngineConfig,
                                                   TensorboardConfig, WandbConfig)
from deepcompile.config.errors import AUTO, ConfigError
from deepcompile.config.faults import FaultToleranceConfig
from deepcompile.config.optim import OPTIMIZER_TYPES, SCHEDULER_TYPES, OptimizerConfig, SchedulerConfig
from deepcompile.config.precision import Bf16Config, Fp16Config
from deepcompile.config.root import Config
from deepcompile.config.zero import OffloadOptimizer, OffloadParam, ZeroConfig

__all__ = [
    "AUTO",
    "Config",
    "ConfigError",
    "ZeroConfig",
    "OffloadParam",
    "OffloadOptimizer",
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
    "FaultToleranceConfig",
    "OPTIMIZER_TYPES",
    "SCHEDULER_TYPES",
    "PASS_NAMES",
]
