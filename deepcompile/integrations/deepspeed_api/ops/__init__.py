"""``deepspeed.ops``: the optimizers accelerate substitutes for a torch optimizer when the config
offloads optimizer state (``map_pytorch_optim_to_deepspeed``), FusedAdam, FusedLamb (refused),
and the op builders with ``__compatible_ops__``, which answer as a DeepSpeed whose optional
C++/CUDA ops are not built (ops/op_builder.py)."""

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.ops import adagrad, adam, aio, lamb, op_builder  # noqa: F401

# op name -> whether its builder can load it here: False for every op (DeepSpeed's
# deepspeed.ops.__compatible_ops__, which programs read before using an op).
__compatible_ops__ = dict(op_builder.COMPATIBLE_OPS)

__getattr__ = module_getattr("deepspeed.ops")
