"""``deepspeed.runtime.fp16.onebit``: DeepSpeed's communication-compressing optimizers.

mmengine (and so xtuner) imports all three to register them when its DeepSpeed strategy is
built, whether or not a config names them; so they import, and refuse when constructed. Each is
defined in the submodule DeepSpeed defines it in (mmengine imports from those too).
"""

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.runtime.fp16.onebit import adam, lamb, zoadam  # noqa: F401
from deepcompile.integrations.deepspeed_api.runtime.fp16.onebit.adam import OnebitAdam  # noqa: F401
from deepcompile.integrations.deepspeed_api.runtime.fp16.onebit.lamb import OnebitLamb  # noqa: F401
from deepcompile.integrations.deepspeed_api.runtime.fp16.onebit.zoadam import ZeroOneAdam  # noqa: F401

__getattr__ = module_getattr("deepspeed.runtime.fp16.onebit")
