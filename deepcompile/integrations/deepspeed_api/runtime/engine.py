"""``deepspeed.runtime.engine``: where DeepSpeed defines its engine class; open-instruct imports
``DeepSpeedEngine`` from here at module level (for type checks), so it is the served one."""

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.engine import DeepSpeedEngine  # noqa: F401

__getattr__ = module_getattr("deepspeed.runtime.engine")
