"""``deepspeed.ops``: the optimizers accelerate substitutes for a torch optimizer when the config
offloads optimizer state (``map_pytorch_optim_to_deepspeed``), FusedAdam, and FusedLamb (refused)."""

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.ops import adagrad, adam, lamb  # noqa: F401

__getattr__ = module_getattr("deepspeed.ops")
