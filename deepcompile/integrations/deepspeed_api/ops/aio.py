"""``deepspeed.ops.aio``: DeepSpeed's NVMe (libaio) op, through its builder. deepcompile builds
no such op and refuses NVMe offload, so ``AsyncIOBuilder().is_compatible()`` is False and
``deepspeed.ops.__compatible_ops__["async_io"]`` too (ops/op_builder.py)."""

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.ops.op_builder import AsyncIOBuilder  # noqa: F401

__getattr__ = module_getattr("deepspeed.ops.aio")
