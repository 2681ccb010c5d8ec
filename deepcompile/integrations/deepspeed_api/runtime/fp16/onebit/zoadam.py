"""``deepspeed.runtime.fp16.onebit.zoadam.ZeroOneAdam``: imports, refuses when constructed (_refusal.py)."""

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.runtime.fp16.onebit._refusal import RefusedOptimizer


class ZeroOneAdam(RefusedOptimizer):
    served_as = "deepspeed.runtime.fp16.onebit.ZeroOneAdam"
    instead = "torch.optim.AdamW"


__getattr__ = module_getattr("deepspeed.runtime.fp16.onebit.zoadam")
