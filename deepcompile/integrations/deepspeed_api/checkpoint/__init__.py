"""``deepspeed.checkpoint``: only ``utils.clone_tensors_for_torch_save``."""

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.checkpoint import utils  # noqa: F401

__getattr__ = module_getattr("deepspeed.checkpoint")
