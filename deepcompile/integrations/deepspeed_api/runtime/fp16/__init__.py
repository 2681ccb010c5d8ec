"""``deepspeed.runtime.fp16``: only ``onebit`` (see there); deepcompile's fp16 is its precision
policy and loss scaler (deepcompile/precision/)."""

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.runtime.fp16 import onebit  # noqa: F401

__getattr__ = module_getattr("deepspeed.runtime.fp16")
