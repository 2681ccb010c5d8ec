"""``deepspeed.runtime.zero``: ``partition_parameters`` and ``offload_config`` (see there)."""

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.runtime.zero import offload_config, partition_parameters  # noqa: F401
from deepcompile.integrations.deepspeed_api.zero import GatheredParameters, Init  # noqa: F401

__getattr__ = module_getattr("deepspeed.runtime.zero")
