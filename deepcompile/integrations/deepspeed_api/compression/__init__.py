"""``deepspeed.compression``: only ``helper``'s two attribute-path functions (see there); model
compression itself is not implemented."""

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.compression import helper  # noqa: F401

__getattr__ = module_getattr("deepspeed.compression")
