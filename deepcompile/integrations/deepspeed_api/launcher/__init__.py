"""``deepspeed.launcher``: only ``runner.DEEPSPEED_ENVIRONMENT_NAME`` (read by ``accelerate launch``)."""

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.launcher import runner  # noqa: F401

__getattr__ = module_getattr("deepspeed.launcher")
