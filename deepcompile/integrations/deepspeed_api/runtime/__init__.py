"""``deepspeed.runtime``: ``lr_schedules`` (accelerate reads its list of schedule names) and
``zero.partition_parameters`` (transformers' zero.Init helper)."""

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.runtime import lr_schedules, zero  # noqa: F401

__getattr__ = module_getattr("deepspeed.runtime")
