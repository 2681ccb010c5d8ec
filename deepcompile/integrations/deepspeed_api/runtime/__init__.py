"""``deepspeed.runtime``: ``lr_schedules`` (accelerate reads its list of schedule names),
``zero.partition_parameters`` (transformers' zero.Init helper), and the modules clients import
classes from: ``engine``, ``base_optimizer``, ``fp16.onebit``; ``sequence_parallel.ulysses_sp`` (DeepSpeed's
ALST / Ulysses entry points accelerate calls)."""

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.runtime import base_optimizer, engine, fp16, lr_schedules, zero  # noqa: F401
from deepcompile.integrations.deepspeed_api.runtime import sequence_parallel  # noqa: F401

__getattr__ = module_getattr("deepspeed.runtime")
